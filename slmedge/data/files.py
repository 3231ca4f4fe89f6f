"""The data slmedge ships, and a user's folder laid over it.

The package carries the calibration text, perplexity corpora and task files its defaults need
(``slmedge/data/shipped``, indexed with licence, provenance and sha256 in ``datasets.json``).
A user's folder of the same layout (``--data-dir`` or ``$SLMEDGE_DATA_DIR``) lies over it: a
file the folder has wins, a file it lacks comes from the package. A shipped file is checked
against its recorded sha256 whenever it is read; a missing or damaged one is an error that
names it and says how to repair it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import DataError
from ..fsutil import sha256_file

DATA_ENV = "SLMEDGE_DATA_DIR"
SHIPPED = Path(__file__).resolve().parent / "shipped"
INDEX = SHIPPED / "datasets.json"
LAYOUT = ("calibration", "perplexity", "tasks")
REPAIR = "reinstall slmedge (pip install --force-reinstall --no-deps slmedge; in a git checkout: git checkout -- slmedge/data)"


@lru_cache(maxsize=1)
def index() -> dict:
    """The shipped data sets: name -> {what, licence, source, files: {relpath: {sha256, bytes, items}}}."""
    try:
        return json.loads(INDEX.read_text(encoding="utf-8"))["sets"]
    except FileNotFoundError:
        raise DataError(f"the index of the shipped data ({INDEX}) is missing; {REPAIR}") from None
    except (ValueError, KeyError) as exc:
        raise DataError(f"the index of the shipped data ({INDEX}) is damaged ({exc}); {REPAIR}") from None


def shipped_files() -> dict[str, dict]:
    """relpath -> its record, over every shipped set."""
    return {rel: rec for s in index().values() for rel, rec in s["files"].items()}


def file_problem(rel: str) -> str | None:
    """Why the shipped file ``rel`` cannot be trusted, or None when it matches its record."""
    rec = shipped_files()[rel]
    path = SHIPPED / rel
    if not path.is_file():
        return f"shipped data file {path} is missing"
    if file_sha256(path) != rec["sha256"]:
        return f"shipped data file {path} is damaged (its sha256 differs from the recorded {rec['sha256'][:12]}…)"
    return None


def file_sha256(path: Path) -> str:
    """sha256 of a data file, hashed once per process while its size and mtime stay the same."""
    stat = path.stat()
    return _digest(str(path), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=256)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


@dataclass(frozen=True)
class DataFiles:
    """Where each data file is read from: the user's ``overlay`` folder if it has it, else the package."""

    overlay: Path | None = None

    def find(self, rel: str) -> Path | None:
        """The file at ``rel`` (e.g. ``tasks/piqa.jsonl``), or None when neither place has it."""
        if self.overlay is not None and (self.overlay / rel).is_file():
            return self.overlay / rel
        if rel in shipped_files():
            problem = file_problem(rel)
            if problem:
                raise DataError(f"{problem}; {REPAIR}")
            return SHIPPED / rel
        return None

    def path(self, rel: str) -> Path:
        found = self.find(rel)
        if found is None:
            where = f"the data folder {self.overlay} nor " if self.overlay else ""
            raise DataError(f"data file {rel} is in neither {where}the data shipped with slmedge")
        return found

    def names(self, folder: str, suffix: str) -> list[str]:
        """Stems of the files directly in ``folder`` with ``suffix``, from both places."""
        prefix = folder.rstrip("/") + "/"
        stems = {Path(rel).stem for rel in shipped_files()
                 if rel.startswith(prefix) and "/" not in rel[len(prefix):] and rel.endswith(suffix)}
        if self.overlay is not None and (self.overlay / folder).is_dir():
            stems.update(p.stem for p in (self.overlay / folder).glob(f"*{suffix}") if p.is_file())
        return sorted(stems)

    def origin(self, rel: str) -> str:
        return "overlay" if self.overlay is not None and (self.overlay / rel).is_file() else "shipped"


def data_files(explicit: str | os.PathLike | None = None) -> DataFiles:
    """The data as a command sees it: ``explicit`` (``--data-dir``), else ``$SLMEDGE_DATA_DIR``, laid
    over the shipped data; neither: the shipped data alone."""
    chosen = explicit or os.environ.get(DATA_ENV)
    if not chosen:
        return DataFiles()
    path = Path(chosen).expanduser()
    if not path.is_dir():
        raise DataError(f"data folder {path} does not exist (from --data-dir or ${DATA_ENV})")
    if not any((path / sub).is_dir() for sub in LAYOUT):
        raise DataError(f"data folder {path} holds none of {', '.join(s + '/' for s in LAYOUT)}: "
                        "give a folder of the shipped layout (see `slmedge data path`)")
    return DataFiles(path.resolve())


def verify() -> tuple[int, list[str]]:
    """Check every shipped file against its recorded sha256: (files checked, problems)."""
    files = shipped_files()
    problems = [p for rel in files if (p := file_problem(rel))]
    return len(files), problems
