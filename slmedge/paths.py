"""User directories and the shared data folder, resolved in one place.

Every location can be moved by an environment variable so that tests (and users with odd
machines) never write into the real home directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir

from .errors import DataError

CACHE_ENV = "SLMEDGE_CACHE_DIR"
DATA_ENV = "SLMEDGE_DATA_DIR"


def cache_dir() -> Path:
    """Where converted models and other reusable work live (``$SLMEDGE_CACHE_DIR``)."""
    path = Path(os.environ.get(CACHE_ENV) or user_cache_dir("slmedge"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _data_candidates() -> list[Path]:
    repo_root = Path(__file__).resolve().parent.parent
    return [repo_root.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]


def data_dir(explicit: str | os.PathLike | None = None, required: bool = True) -> Path | None:
    """The benchmark data folder: ``explicit``, else ``$SLMEDGE_DATA_DIR``, else ``../shared/data``.

    The data is read where it lies; slmedge never copies it.
    """
    chosen = explicit or os.environ.get(DATA_ENV)
    if chosen:
        path = Path(chosen).expanduser()
        if not path.is_dir():
            raise DataError(f"data folder {path} does not exist (from --data-dir or ${DATA_ENV})")
        return path
    for cand in _data_candidates():
        if cand.is_dir():
            return cand
    if required:
        raise DataError(
            "no data folder found: pass --data-dir or set $SLMEDGE_DATA_DIR to the folder that "
            "holds calibration/, perplexity/ and tasks/"
        )
    return None
