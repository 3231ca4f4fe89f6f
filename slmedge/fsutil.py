"""Files written so that a reader never sees half of them, one writer at a time.

Everything slmedge writes where a finished result is expected goes through here: a file is
written under a temporary name in the same folder and renamed; a directory is built under a
hidden temporary name beside its destination and renamed when complete.

One writer per output: while ``NAME`` is written its writer holds an advisory lock (``flock``) on
``.slmedge-lock-NAME`` beside it (``output_lock``), which the operating system releases however the
process ends. A second writer of the same output is refused with the holder's PID and command, or
waits (caches, where the second finds the first's result). Temporary names are
``.slmedge-tmp-<pid>-<hex8>-<kind>-NAME``: whoever holds NAME's lock knows that no one else writes
NAME, and removes the temporary names of NAME whose PID is not alive; on taking a lock, the writer
also removes what dead runs left for other names in the same folder (their locks free), and lock
files no one holds. Nothing else is ever removed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

from .errors import DataError, DiskFullError, OutputError, OutputExistsError, SlmedgeError

_TMP_MARK = ".slmedge-tmp-"
LOCK_MARK = ".slmedge-lock-"
TMP_KINDS = ("file", "dir", "stage", "old")  # what a temporary name holds (old: a replaced folder)
_TMP = re.compile(r"\.slmedge-tmp-(?P<pid>\d+)-[0-9a-f]{8}-(?P<kind>file|dir|stage|old)-(?P<name>.+)", re.S)
# Names written by slmedge before the kinds: "<uuid32>-NAME" (files), "<pid>-NAME" and "<pid>-old-NAME"
# (folders), "<pid>-<hex8>-NAME" and "<pid>-<hex8>-stage-NAME" (GGUF). Removed only when their process
# is gone (a NAME may parse two ways: each reading is a dead run's).
_LEGACY = (re.compile(r"\.slmedge-tmp-[0-9a-f]{32}-(?P<name>.+)", re.S),
           re.compile(r"\.slmedge-tmp-(?P<pid>\d+)-[0-9a-f]{8}-stage-(?P<name>.+)", re.S),
           re.compile(r"\.slmedge-tmp-(?P<pid>\d+)-[0-9a-f]{8}-(?P<name>.+)", re.S),
           re.compile(r"\.slmedge-tmp-(?P<pid>\d+)-old-(?P<name>.+)", re.S),
           re.compile(r"\.slmedge-tmp-(?P<pid>\d+)-(?P<name>.+)", re.S))


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


def check_seal(manifest: dict, where, error: type = SlmedgeError, required: bool = False) -> None:
    """Raise ``error`` when a sealed manifest's content no longer matches its seal, or (``required``:
    the manifest is of a format slmedge has always written sealed) when it has no seal at all: a seal
    that was removed, with whatever edit it covered. ``required=False`` is for the formats written
    before seals existed (artifact format 1), whose files' checksums and quantization metadata still
    hold."""
    recorded = manifest.get(SEAL_KEY) if isinstance(manifest, dict) else None
    if recorded is None and required:
        raise error(f"{where} has no {SEAL_KEY}, and slmedge writes every manifest of its kind sealed: its seal was "
                    "removed, and any edit it covered cannot be seen; it cannot be trusted; write it again")
    if recorded is not None and recorded != manifest_digest(manifest):
        raise error(f"{where} was changed after slmedge wrote it (its content no longer matches its "
                    f"{SEAL_KEY}): it cannot be trusted; write it again")


def write_json_atomic(path: str | os.PathLike, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` under a temporary name beside ``path``, then rename it into place (a writer of
    the same path at the same time waits for this one). Missing folders above ``path`` are created
    (as compress and export create theirs), and removed again when the write fails; a full disk is a
    DiskFullError naming ``path`` and the bytes it needed."""
    path = Path(path)
    data = text.encode("utf-8")
    with output_lock(path, wait=True):
        tmp = temp_name(path, "file")
        try:
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            if disk_full(exc):
                raise no_space(path, len(data)) from exc
            raise
        finally:
            tmp.unlink(missing_ok=True)


def temp_name(dest: str | os.PathLike, kind: str = "file") -> Path:
    """A temporary name beside ``dest`` that becomes it (``kind``: file, dir, stage, old); write under
    it only while holding ``output_lock(dest)``, which is what lets the next writer remove it when this
    run is killed."""
    if kind not in TMP_KINDS:
        raise ValueError(f"temporary kind must be one of {TMP_KINDS}, not {kind!r}")
    dest = Path(dest)
    return dest.with_name(f"{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}-{kind}-{dest.name}")


# A temporary name anywhere in a text (a message naming a file being written): what user_paths removes.
_TMP_IN_TEXT = re.compile(r"\.slmedge-tmp-(?:\d+-[0-9a-f]{8}-(?:file|dir|stage|old)|[0-9a-f]{32}|\d+(?:-[0-9a-f]{8})?"
                          r"(?:-stage|-old)?)-")


def user_paths(text: str) -> str:
    """``text`` with every temporary name slmedge writes under replaced by the name it becomes: a
    message names the user's NAME, never ``.slmedge-tmp-<pid>-<hex8>-<kind>-NAME`` (nor earlier
    versions' ``.slmedge-tmp-<uuid>-NAME``, ``.slmedge-tmp-<pid>[-<hex8>][-stage|-old]-NAME``)."""
    return _TMP_IN_TEXT.sub("", text)


def temp_of(entry_name: str) -> tuple[str, int | None, str] | None:
    """(the NAME it becomes, the PID that wrote it or None, its kind) of a temporary name slmedge wrote;
    None for any other name. Names of earlier versions read with kind "legacy"."""
    m = _TMP.fullmatch(entry_name)
    if m:
        return m["name"], int(m["pid"]), m["kind"]
    for pattern in _LEGACY:
        m = pattern.fullmatch(entry_name)
        if m:
            pid = m.groupdict().get("pid")
            return m["name"], (int(pid) if pid else None), "legacy"
    return None


# --- one writer per output -------------------------------------------------------------------------


class OutputBusyError(OutputError):
    """Another process is writing the same output now."""


_held: dict[str, list] = {}  # this process's locks: output path -> [fd, depth, lock file, folders made]


def _lock_file(dest: Path) -> Path:
    return dest.with_name(LOCK_MARK + dest.name)


def _holder_text() -> bytes:
    import shlex
    import socket

    argv = list(sys.argv) or ["python"]
    # The command line however it was started (the console script, python -m, -c): "slmedge ...".
    argv[0] = "slmedge" if "slmedge.cli" in sys.modules else (Path(argv[0]).name or argv[0])
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": shlex.join(argv)[:300],
                       "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode()


def _holder(lock: Path) -> str:
    """Who holds ``lock``, as its holder wrote it down: 'PID 123: slmedge export ...' (or less)."""
    import socket

    try:
        info = json.loads(lock.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "its PID is not recorded yet"
    if not isinstance(info, dict):
        return "its PID is not recorded"
    host = info.get("host")
    where = f" on {host}" if host and host != socket.gethostname() else ""
    return f"PID {info.get('pid')}{where}, since {info.get('since')}: {info.get('command')}"


def _acquire(lock: Path, wait: bool) -> int | None:
    """An fd holding ``lock`` exclusively; None when another process holds it (``wait=False``)."""
    import fcntl

    for attempt in range(1000):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            if lock.parent.is_dir():  # a folder that takes no new file (/proc): said by the caller
                raise
            lock.parent.mkdir(parents=True, exist_ok=True)  # removed by a writer that made it and failed
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        # The holder before us removes the file as it lets go: a lock taken on a file no longer at
        # this name locks nothing; take it again.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            same = False
        if same or attempt == 999:  # (a file system whose inode numbers do not hold: the lock as taken)
            return fd
        os.close(fd)
    raise OSError(errno.EAGAIN, "the lock file keeps changing", str(lock))


def _release(fd: int, lock: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(lock)  # still holding it: the next writer finds no file, or a new one
    os.close(fd)


@contextlib.contextmanager
def output_lock(dest: str | os.PathLike, wait: bool = False, what: str | None = None,
                advice: str = "wait for it to finish, or choose another output") -> Iterator[Path]:
    """Hold ``dest``'s lock while it is written (re-entrant within a process): an advisory lock on
    ``.slmedge-lock-NAME`` beside it, which the OS releases if this process dies. Another process
    holding it: ``wait``, or raise OutputBusyError naming that process (``what``: how the message names
    the output). Missing folders above ``dest`` are created, and removed again when nothing was written
    in them. Once held, what killed runs left beside ``dest`` is removed (``remove_stale``)."""
    dest = Path(os.path.realpath(dest))  # one key per file, however it is named (a nested writer re-enters)
    key = str(dest)
    if key in _held:
        _held[key][1] += 1
        try:
            yield dest
        finally:
            _held[key][1] -= 1
        return
    made = []
    up = dest.parent
    while not up.exists() and up != up.parent:
        made.append(up)
        up = up.parent
    lock = _lock_file(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd = _acquire(lock, wait)
    except OSError as exc:
        _remove_made(made)
        if dest.parent.exists() and not dest.parent.is_dir():
            raise OutputError(f"cannot write {what or dest}: {dest.parent} is a file, not a folder") from exc
        reason = "no space left on the device" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc)).lower()
        raise OutputError(f"cannot write {what or dest}: {dest.parent} does not take new files ({reason})") from exc
    if fd is None:
        _remove_made(made)
        raise OutputBusyError(f"{what or dest} is being written by another slmedge process ({_holder(lock)}); "
                              f"{advice}")
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, _holder_text(), 0)
    except OSError:
        pass  # the lock holds without the note (a full disk): the message then names no PID
    _held[key] = [fd, 1, lock, made]
    try:
        remove_stale(dest.parent, own=dest.name)
        yield dest
    finally:
        del _held[key]
        _release(fd, lock)
        _remove_made(made)


def _remove_made(made: list[Path]) -> None:
    for folder in made:  # deepest first; one that holds anything stays
        try:
            folder.rmdir()
        except OSError:
            break


def remove_stale(folder: Path, own: str | None = None) -> list[str]:
    """Remove what killed slmedge runs left in ``folder``: the temporary names of every output whose
    lock no one holds (``own``: the NAME this process holds the lock of), and lock files no one
    holds. A replaced folder kept aside (kind ``old``) whose output is missing is put back instead (a
    run killed between the two renames of ``atomic_directory``). Returns the names removed."""
    removed: list[str] = []
    try:
        entries = [e for e in os.listdir(folder) if e.startswith((_TMP_MARK, LOCK_MARK))]
    except OSError:
        return removed
    temps: dict[str, list[tuple[str, int | None, str]]] = {}
    names = set()
    for e in entries:
        if e.startswith(LOCK_MARK):
            names.add(e[len(LOCK_MARK):])
            continue
        found = temp_of(e)
        if found is not None:
            temps.setdefault(found[0], []).append((e, found[1], found[2]))
            names.add(found[0])
    for name in sorted(names):
        dest = Path(folder) / name
        if name == own:
            removed += _remove_temps(dest, temps.get(name, []))
            continue
        if os.path.realpath(dest) in _held:
            continue  # this process writes it now
        lock = _lock_file(dest)
        try:
            fd = _acquire(lock, wait=False)
        except OSError:
            continue  # a folder that takes no lock file (read-only): nothing can be removed either
        if fd is None:
            continue  # being written now
        try:
            removed += _remove_temps(dest, temps.get(name, []))
        finally:
            _release(fd, lock)
    return removed


# A temporary name without a PID (an earlier version's files) is removed only once this old: its
# writer, which took no lock, finished or died long ago (a file is written in well under a minute).
_PIDLESS_AGE_S = 600


def _remove_temps(dest: Path, temps: list[tuple[str, int | None, str]]) -> list[str]:
    """Remove ``dest``'s temporary names, its lock held, where the process that wrote them is gone:
    nobody holds the lock, and the PID in the name is not alive (another process's PID on this machine
    keeps a name: an earlier version, which took no lock, may be writing it; a PID reused since
    only delays the removal). A finished folder set aside by a kill (kind ``old``) is put back when
    ``dest`` is missing. Returns the names removed."""
    removed = []
    olds = []
    now = time.time()
    for entry, pid, kind in temps:
        path = dest.with_name(entry)
        if pid is not None and pid != os.getpid() and _pid_alive(pid):
            continue
        if pid is None:
            try:
                if now - path.lstat().st_mtime < _PIDLESS_AGE_S:
                    continue
            except OSError:
                continue
        if kind == "old" or (kind == "legacy" and "-old-" in entry):
            olds.append(path)
            continue
        _remove(path)
        removed.append(entry)
    olds.sort(key=lambda p: p.stat().st_mtime if p.exists() else 0, reverse=True)
    for i, path in enumerate(olds):
        if i == 0 and not dest.exists() and path.is_dir():
            try:
                os.replace(path, dest)  # the finished output a kill had set aside: back in its place
            except OSError:
                pass  # left as it is: never removed while it may be the only copy
            continue
        _remove(path)
        removed.append(path.name)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


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
    """Whether a process ``pid`` runs on this machine (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # no /proc: what kill says


@contextlib.contextmanager
def atomic_directory(dest: str | os.PathLike, overwrite: bool = False, manifest: str | None = None,
                     needed: int | None = None) -> Iterator[Path]:
    """Yield an empty temporary directory that becomes ``dest`` only if the block succeeds.
    With ``manifest``, an existing ``dest`` is replaced only if everything in it is what slmedge
    wrote there (that manifest lists it).

    ``dest``'s lock is held throughout (``output_lock``; a writer that took it first, to refuse a
    second writer before any work, keeps it; otherwise another writer of ``dest`` is waited for).
    On any exception (KeyboardInterrupt included) the temporary directory is removed and
    ``dest`` is left exactly as it was; a full disk is a DiskFullError naming ``dest`` and the bytes
    it ``needed`` (when the writer says; else what had been written when the disk filled). A run
    killed outright leaves only a hidden ``.slmedge-tmp-*`` directory, which the next run that writes
    there removes.
    """
    dest = Path(dest).resolve()
    with output_lock(dest, wait=True):
        tmp = temp_name(dest, "dir")
        tmp.mkdir()
        try:
            yield tmp
            if dest.exists():
                refuse_replacing(dest, overwrite, manifest)
                old = temp_name(dest, "old")
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
