"""Processes slmedge starts die with the process that started them, however it ends.

A study's workers, the memory probe, a target's runner (local, emulated under qemu, or ssh and
scp sessions), the emulated target's set-up tools: each is a child that would otherwise outlive a
``kill -9``, an out-of-memory kill or a CI timeout of slmedge, reparented to PID 1, holding its
memory (a study's worker: ~550 MB) for as long as its work takes. On Linux the child asks the
kernel to send it SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``, through ctypes);
where that is unavailable a watchdog thread in a Python child ends it once its parent is gone.
multiprocessing's resource tracker ends by itself when the last process holding its pipe (the
parent and the workers) is gone.

A child that is itself a Python process slmedge runs (a study's worker, the supervised command of
``slmedge.supervise``) calls ``die_with_parent`` first thing; any other program is started with
``child_options()`` (a ``preexec_fn`` that does the same between fork and exec).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1


def _prctl():
    """libc's prctl, or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.prctl
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        return fn
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()  # resolved once, before any fork: the child only calls it


def _watchdog(parent: int, interval: float = 0.5) -> None:
    """A daemon thread that kills this process once ``parent`` is no longer its parent."""

    def watch():
        import time

        while True:
            if os.getppid() != parent:
                os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))
            time.sleep(interval)

    threading.Thread(target=watch, name="slmedge-parent-watchdog", daemon=True).start()


def die_with_parent(parent: int | None = None, watchdog: bool = True) -> str:
    """Make this process end when ``parent`` (the process that started it) ends, however it ends.
    Returns how: "prctl", "watchdog", or "gone" (the parent had already ended: this process exits).

    Linux: the kernel sends SIGKILL at the parent's death. Elsewhere (``watchdog``): a thread checks
    the parent every half second. Call it first thing in the child: a parent that died before the
    call is seen by the parent-pid check that follows, and this process exits then."""
    parent = os.getppid() if parent is None else parent
    how = "watchdog"
    if _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
        how = "prctl"
    elif watchdog:
        _watchdog(parent)
    if os.getppid() != parent:  # the parent ended before the line above: nothing would kill us now
        os._exit(1)
        return "gone"  # (not reached)
    return how


def _preexec(parent: int) -> None:
    """Between fork and exec of a child program: its death is tied to ``parent`` (this process). Only
    the syscall and a pid check: nothing here may take a lock another thread could hold."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def child_options() -> dict:
    """Keyword arguments for ``subprocess.run``/``Popen`` of a program slmedge starts: on Linux it is
    killed when this process dies. The ``preexec_fn`` is the one ``ray`` uses for the same purpose;
    it runs in the forked child before exec, and does nothing but the syscall."""
    if _PRCTL is None:
        return {}
    parent = os.getpid()
    return {"preexec_fn": lambda: _preexec(parent)}


# --- a stop asked from outside: SIGTERM, SIGHUP, and kill -INT ---------------------------------------
#
# Ctrl-C raises KeyboardInterrupt, and every command already answers that: its temporary files and
# locks go, the evaluation it was recording is marked failed, one line (``interrupted``) and exit 130.
# SIGTERM (``kill PID``, a scheduler, systemd, a CI timeout) and SIGHUP (a terminal closed) are
# answered the same way: ``stop_on_signals`` makes them raise ``Stopped``, a KeyboardInterrupt, in the
# main thread; the command line then says ``terminated (SIGTERM)`` and exits 128 + N.


class Stopped(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM or SIGHUP (``stop_on_signals``): the command stops as
    on Ctrl-C, then exits 128 + ``signum``. ``str()`` is the line said and the reason recorded."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        try:
            name = signal.Signals(self.signum).name
        except ValueError:
            name = f"signal {self.signum}"
        return f"terminated ({name})"


STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))
_stopping: list[float] = []  # when the last stop was raised


def _stop(signum, frame) -> None:
    import time

    now = time.monotonic()
    # A stop sent to the process group by a process reaches the supervised child twice (directly and
    # passed on by its supervisor), a few microseconds apart: the second would break into the first
    # one's clean-up. One stop per second; a later one stops the clean-up, as a second Ctrl-C does.
    if _stopping and now - _stopping[-1] < 1.0:
        return
    _stopping.append(now)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(signum)


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP raise ``Stopped`` in the main thread, SIGINT KeyboardInterrupt (once per
    second); a signal this process was started with ignored (``nohup``: SIGHUP) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (*STOP_SIGNALS, signal.SIGINT):
        if signal.getsignal(sig) in (signal.SIG_IGN, None):
            continue
        signal.signal(sig, _stop)


def stop_code(exc: BaseException) -> int:
    """The exit code of a command stopped by ``exc``: 128 + N for a signal N, 130 for Ctrl-C."""
    return 128 + exc.signum if isinstance(exc, Stopped) else 130


# --- a native crash, told in one line -----------------------------------------------------------
#
# A segfault in llama.cpp or onnxruntime ends the process that runs it at once: no Python code runs,
# no message. ``supervise`` forks: the child runs the command; the parent replaces itself (exec, same
# PID, still the child's parent) by a small Python that loads nothing of the command's (~10 MB instead
# of keeping every page the child changes since the fork: ~220 MB more at the end of a SmolLM2
# evaluation), waits for the child and, when it died of a signal, says in one line which native code
# was running on which file. The child keeps that in a page both share (a memfd, inherited across
# exec): ``native`` (what runs now, innermost last) and ``note`` (facts the parent needs then, such as
# the results store's run to mark failed).

_SLOT = None  # the shared page, in a supervised child
_native: list[tuple[str, str | None]] = []  # (what, file) of the native work running now, innermost last
_notes: dict = {}
SLOT_BYTES = 1 << 14


def _publish() -> None:
    if _SLOT is None:
        return
    import json

    body = json.dumps({"native": _native[-1] if _native else None, "notes": _notes}, default=str).encode()
    body = body[: len(_SLOT) - 8] if len(body) > len(_SLOT) - 8 else body
    _SLOT[8: 8 + len(body)] = body
    _SLOT[:8] = len(body).to_bytes(8, "little")  # the length last: a reader sees a whole record or the last one


class native:  # noqa: N801 - used as a context manager, like contextlib's
    """``with native("llama.cpp", path):`` around native work (a runtime's call, a quantizer): if the
    process dies inside, the supervising parent names ``what`` and ``path``. Cheap (a list push and
    pop; one small write into shared memory when supervised)."""

    __slots__ = ("entry",)

    def __init__(self, what: str, path=None):
        self.entry = (what, None if path is None else str(path))

    def __enter__(self):
        same = bool(_native) and _native[-1] == self.entry
        _native.append(self.entry)
        if not same:  # a call inside a call of the same runtime on the same file (a decode step) says nothing new
            _publish()
        return self

    def __exit__(self, *exc):
        left = _native.pop() if _native else None
        if not _native or _native[-1] != left:
            _publish()
        return False


def note(key: str, value) -> None:
    """Record (``value`` None: forget) a fact the supervising parent needs if this process dies."""
    if value is None:
        _notes.pop(key, None)
    else:
        _notes[key] = value
    _publish()


def _read(slot) -> dict:
    import json

    try:
        n = int.from_bytes(slot[:8], "little")
        return json.loads(bytes(slot[8: 8 + n]).decode("utf-8")) if n else {}
    except (ValueError, UnicodeDecodeError):
        return {}


def supervise(command: str, waiter: str | None = None) -> tuple[int, dict | None] | None:
    """Fork. In the child: None (go on with the command; it dies with its parent). The parent: with
    ``waiter`` (a Python file: ``waiter PID FD COMMAND``, calling ``wait_for_child``) on Linux, it
    execs that file (never returns); otherwise it waits here and returns ``wait_for_child``'s answer.
    Where fork is not available: None (the command runs here, unsupervised)."""
    import mmap

    if not hasattr(os, "fork"):
        return None
    fd = None
    if waiter is not None and hasattr(os, "memfd_create"):
        fd = os.memfd_create("slmedge-supervisor", 0)
        os.ftruncate(fd, SLOT_BYTES)
        slot = mmap.mmap(fd, SLOT_BYTES)
    else:
        slot = mmap.mmap(-1, SLOT_BYTES)  # anonymous, shared with the child across fork
    for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    import gc

    gc.freeze()  # the objects loaded so far are never traversed by the child's GC: their pages stay shared
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        global _SLOT
        _SLOT = slot
        if fd is not None:
            os.close(fd)
        die_with_parent(parent)
        _publish()
        return None
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the child too; it answers
    if fd is None:
        return wait_for_child(pid, slot)
    os.set_inheritable(fd, True)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        os.execv(sys.executable, [sys.executable, "-S", waiter, str(pid), str(fd), command, package_root])
    except OSError:  # no interpreter to exec (an embedded one, a packed app): wait here, as large as we are
        return wait_for_child(pid, slot)
    raise AssertionError("exec returned")  # (not reached)


def _one_thread() -> bool:
    """Whether this process runs one thread (native ones counted: a signal may reach any of them)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


SI_KERNEL = 0x80  # siginfo's si_code of a signal the kernel sent: a terminal's Ctrl-C (to the whole group)


def wait_for_child(pid: int, slot) -> tuple[int, dict | None]:
    """Wait for the supervised child ``pid``: (exit code, None) for a child that exited; (128 + N, what
    it was doing) for one that died of signal N (``{"signal": N, "native": [what, file] | None,
    "notes": {...}}``), read from ``slot``.

    SIGTERM, SIGHUP and SIGQUIT are passed on to the child (which stops as on Ctrl-C, says so and exits
    128 + N); a child that dies of one of them instead makes this process end by the same signal, as
    the one who sent it expects. SIGINT is passed on when a process sent it (``kill -INT PID``, to this
    PID alone), not when a terminal did: a terminal's Ctrl-C reaches the whole process group, the child
    included, which answers it. Telling the two apart needs the signal's sender (``sigtimedwait``);
    where that is not available, SIGINT is ignored here."""
    forwarded: list[int] = []

    def forward(signum, frame=None):
        forwarded.append(signum)
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    stops = [s for s in (getattr(signal, n, None) for n in ("SIGTERM", "SIGHUP", "SIGQUIT")) if s is not None
             and signal.getsignal(s) != signal.SIG_IGN]  # one started ignored (nohup: SIGHUP) stays ignored
    waits = hasattr(signal, "sigtimedwait") and _one_thread()  # the exec'd supervisor: a mask blocks in one thread
    if waits:
        watched = {signal.SIGCHLD, signal.SIGINT, *stops}
        signal.pthread_sigmask(signal.SIG_BLOCK, watched)  # kept pending until taken here, ignored ones too
        for sig in (signal.SIGINT, *stops):
            signal.signal(sig, signal.SIG_DFL)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            info = signal.sigtimedwait(watched, 1.0)  # SIGCHLD, or a second on the way: the check above again
            if info is None or info.si_signo == signal.SIGCHLD:
                continue
            if info.si_signo == signal.SIGINT and info.si_code == SI_KERNEL:
                continue  # a terminal's Ctrl-C: the child has it too
            forward(info.si_signo)
    else:
        for sig in stops:
            signal.signal(sig, forward)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    signum = os.WTERMSIG(status)
    if signum in forwarded:  # asked to stop from outside: end the same way
        signal.signal(signum, signal.SIG_DFL)
        if waits:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        os.kill(os.getpid(), signum)
    return 128 + signum, {"signal": signum, **_read(slot)}


def crash_message(command: str, died: dict) -> str:
    """The one line for a supervised command whose process died of a signal (``wait_for_child``)."""
    from .fsutil import user_paths

    signum = died.get("signal")
    how = signal_text(signum)
    running = died.get("native")
    what, path = (running[0], user_paths(running[1]) if running[1] else None) if running else (None, None)
    on = f" on {path}" if path else " on the model in memory"
    if signum == getattr(signal, "SIGKILL", None):
        during = f" while {what} was running{on}" if what else ""
        return (f"slmedge {command} was killed ({how}){during}: by the out-of-memory killer or another process; "
                "nothing it was doing was recorded as finished")
    if what:
        return (f"{what} crashed ({how}){on}: the file may be damaged or not what {what} expects, or {what} has a "
                "bug; nothing it was doing was recorded as finished")
    return (f"slmedge {command} crashed ({how}) in native code outside a runtime; nothing it was doing was recorded "
            "as finished; run it again with --debug to see where")


SIGNAL_WORDS = {"SIGSEGV": "segmentation fault", "SIGABRT": "aborted", "SIGBUS": "bus error",
                "SIGFPE": "arithmetic error", "SIGILL": "illegal instruction", "SIGKILL": "killed",
                "SIGTERM": "terminated", "SIGSYS": "bad system call", "SIGTRAP": "trap"}


def signal_text(signum: int) -> str:
    """'SIGSEGV, segmentation fault' for 11 (the name and what it means; the number where unnamed)."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
    return f"{name}, {SIGNAL_WORDS[name]}" if name in SIGNAL_WORDS else name
