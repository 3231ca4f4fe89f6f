"""Files written so that a reader never sees half of them.

Everything slmedge writes where a finished result is expected goes through here: a file is
written under a temporary name in the same folder and renamed; a directory is built under a
hidden temporary name beside its destination and renamed when complete.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Iterator

from .errors import DataError, DiskFullError, OutputExistsError, SlmedgeError

_TMP_MARK = ".slmedge-tmp-"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, object]]:
    """(line number, record) for each non-blank line of a UTF-8 JSON-lines file; a line that is
    not JSON, or bytes that are not UTF-8, are a DataError naming the file (and line)."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as handle:
            for line_no, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    yield line_no, json.loads(line)
                except ValueError as exc:
                    raise DataError(f"{path}:{line_no} is not valid JSON") from exc
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text") from exc


# A manifest slmedge writes carries the sha256 of its own content under this key, so an edit of
# the manifest (bits 4 -> 8 in an artifact's slmedge.json) shows on the next read.
SEAL_KEY = "manifest_sha256"


def manifest_digest(manifest: dict) -> str:
    """The sha256 of a manifest's content without its seal: canonical JSON (sorted keys, no
    spaces) of the value as it reads back from disk, so a written and a re-read manifest agree."""
    body = json.loads(json.dumps({k: v for k, v in manifest.items() if k != SEAL_KEY}, default=str))
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"),
                                     ensure_ascii=False).encode("utf-8")).hexdigest()


def sealed(manifest: dict) -> dict:
    """``manifest`` with its seal (the digest of the rest) added."""
    return {**{k: v for k, v in manifest.items() if k != SEAL_KEY}, SEAL_KEY: manifest_digest(manifest)}


def check_seal(manifest: dict, where, error: type = SlmedgeError) -> None:
    """Raise ``error`` when a sealed manifest's content no longer matches its seal. A manifest
    without one (written before seals existed) passes: its files' checksums still hold."""
    recorded = manifest.get(SEAL_KEY) if isinstance(manifest, dict) else None
    if recorded is not None and recorded != manifest_digest(manifest):
        raise error(f"{where} was changed after slmedge wrote it (its content no longer matches its "
                    f"{SEAL_KEY}): it cannot be trusted; write it again")


def write_json_atomic(path: str | os.PathLike, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` under a temporary name beside ``path``, then rename it into place. Missing
    folders above ``path`` are created (as compress and export create theirs), and removed again
    when the write fails; a full disk is a DiskFullError naming ``path`` and the bytes it needed."""
    path = Path(path)
    data = text.encode("utf-8")
    made = make_parents(path)
    tmp = path.with_name(f"{_TMP_MARK}{uuid.uuid4().hex}-{path.name}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        remove_made(made)
        if isinstance(exc, Exception) and disk_full(exc):
            raise no_space(path, len(data)) from exc
        raise
    finally:
        tmp.unlink(missing_ok=True)


def make_parents(path: Path) -> list[Path]:
    """Create the missing folders above ``path``; returns those it created, the deepest first."""
    made = []
    parent = Path(path).parent
    while not parent.exists() and parent != parent.parent:
        made.append(parent)
        parent = parent.parent
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return made


def remove_made(made: list[Path]) -> None:
    """Remove folders ``make_parents`` created, deepest first, where they are still empty."""
    for folder in made:
        try:
            folder.rmdir()
        except OSError:
            return


def mb(n: int | float) -> str:
    """A size in MB for a message: 0.02, 3.4, 512."""
    n = n / 1e6
    return f"{n:.0f}" if n >= 10 else f"{n:.1f}" if n >= 1 else f"{max(n, 0.01):.2f}"


def no_space(path, needed: int | None, *, at_least: bool = False,
             left: str = "nothing was written there") -> DiskFullError:
    """The error for a full disk while writing ``path``: ``no space left on PATH (needed about N MB)``
    (``at_least``: N is what had been written when the disk filled, so the need is more), then what
    was ``left`` as it was."""
    if needed is None:
        size = ""
    else:
        size = f" (needed {'more than' if at_least else 'about'} {mb(needed)} MB)"
    return DiskFullError(f"no space left on {path}{size}; {left}", path, needed)


def disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what it wraps) says the disk is full: an OSError with ENOSPC, or a
    library's own error around one (safetensors' writer raises ``SafetensorError: Error while
    serializing: I/O error: No space left on device (os error 28)``, not an OSError)."""
    for _ in range(8):  # the chain of causes, bounded
        if exc is None:
            return False
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        text = str(exc).lower()
        if "no space left on" in text or "database or disk is full" in text:  # ours, the C library's, SQLite's
            return True
        # numpy's tofile (the GGUF writer's tensor data) reports a short write without an errno
        if isinstance(exc, OSError) and re.search(r"\d+ requested and \d+ written", text):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def foreign_entries(path: Path, manifest: str | None) -> list[str]:
    """What the directory ``path`` holds that slmedge did not write there: every entry its
    ``manifest`` (slmedge's own, listing ``files``) does not name; all of them without one."""
    entries = sorted(p.name for p in path.iterdir())
    try:
        listed = set(json.loads((path / manifest).read_text(encoding="utf-8"))["files"]) if manifest else None
    except (OSError, ValueError, KeyError, TypeError):
        listed = None
    if listed is None:
        return entries
    return [n for n in entries if n != manifest and n not in listed]


def _related(a: Path, b: Path) -> bool:
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


def refuse_replacing(path: Path, overwrite: bool, manifest: str | None, inputs=()) -> None:
    """The checks before ``path`` (a directory or a file) may be written: never an input of the same
    command (nor a folder inside one or holding one); a folder that holds something only with
    ``overwrite``, and only when everything in it is what slmedge wrote there (``manifest``)."""
    for src in inputs:
        if src is not None and Path(src).exists() and _related(path, Path(src)):
            raise OutputExistsError(f"output {path} is (or holds, or is inside) the input {src}; choose another output")
    if path.is_dir() and any(path.iterdir()):
        # What slmedge did not write there first: --overwrite is advised only where it would then work.
        foreign = foreign_entries(path, manifest)
        if manifest is not None and foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise OutputExistsError(f"output directory {path} holds what slmedge did not write there ({shown}); "
                                    "--overwrite only replaces slmedge's own outputs: choose another output")
        if not overwrite:
            raise OutputExistsError(f"output directory {path} is not empty; pass --overwrite to replace it")


def check_output_dir(path: str | os.PathLike, overwrite: bool, manifest: str | None = None, inputs=()) -> Path:
    """Refuse, before any work, an output directory that may not be replaced (``refuse_replacing``)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputExistsError(f"output {path} exists and is not a directory")
    refuse_replacing(path, overwrite, manifest, inputs)
    # Nothing is created here (the writer makes the parents when it writes): the nearest folder
    # that exists must let us create what is missing below it.
    parent = path.resolve().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise SlmedgeError(f"cannot write {path}: {parent} is not a writable folder")
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(parent: Path, name: str) -> None:
    """Remove temporary directories of earlier runs for ``name`` whose process is gone."""
    for entry in parent.glob(f"{_TMP_MARK}*-{name}"):
        try:
            pid = int(entry.name[len(_TMP_MARK):].split("-", 1)[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(dest: str | os.PathLike, overwrite: bool = False, manifest: str | None = None,
                     needed: int | None = None) -> Iterator[Path]:
    """Yield an empty temporary directory that becomes ``dest`` only if the block succeeds.
    With ``manifest``, an existing ``dest`` is replaced only if everything in it is what slmedge
    wrote there (that manifest lists it).

    On any exception (KeyboardInterrupt included) the temporary directory is removed and
    ``dest`` is left exactly as it was; a full disk is a DiskFullError naming ``dest`` and the bytes
    it ``needed`` (when the writer says; else what had been written when the disk filled). A run killed outright leaves only a hidden
    ``.slmedge-tmp-*`` directory, which the next run cleans up.
    """
    dest = Path(dest).resolve()
    parent = dest.parent
    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(parent, dest.name)
    tmp = parent / f"{_TMP_MARK}{os.getpid()}-{dest.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if dest.exists():
            refuse_replacing(dest, overwrite, manifest)
            old = parent / f"{_TMP_MARK}{os.getpid()}-old-{dest.name}"
            os.replace(dest, old) if dest.is_dir() else dest.unlink()
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except Exception as exc:
        written = _tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if disk_full(exc):  # named by the destination, never the temporary folder
            known = needed or (exc.needed if isinstance(exc, DiskFullError) else None)
            raise no_space(dest, known or written, at_least=not known) from exc
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _tree_bytes(folder: Path) -> int:
    """The bytes of the files under ``folder`` (0 where it cannot be read)."""
    try:
        return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    except OSError:
        return 0


def proc_kib_field(path: str, key: str) -> int | None:
    """A ``key: N kB`` line of a /proc file, in bytes (None where the file or the line is missing)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    return proc_kib_field("/proc/meminfo", "MemAvailable")
