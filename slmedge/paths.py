"""User directories, resolved in one place (the data folder: ``slmedge.data.files``).

Every location can be moved by an environment variable so that tests (and users with odd
machines) never write into the real home directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir

CACHE_ENV = "SLMEDGE_CACHE_DIR"


def cache_dir() -> Path:
    """Where converted models and other reusable work live (``$SLMEDGE_CACHE_DIR``)."""
    path = Path(os.environ.get(CACHE_ENV) or user_cache_dir("slmedge"))
    path.mkdir(parents=True, exist_ok=True)
    return path
