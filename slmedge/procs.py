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

