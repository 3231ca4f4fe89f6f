"""Running the real command line in another process, held at a chosen point of its work; and the
process table (what a process started, what is still alive).

A command is held by wrapping one of slmedge's own functions in the child process: the wrapper
writes a file (so the test knows the command got there, with its temporary files on disk) and
sleeps, then calls the real function. Nothing is replaced: the command does its real work before
and after the pause.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def held_at(module: str, attr: str, ready: Path, seconds: float = 60.0) -> str:
    """Python source that makes ``module.attr`` (a function) write ``ready``, then sleep ``seconds``
    before doing its work (each call: the first one holds the command)."""
    return (f"import {module} as _m, time as _t, pathlib as _p\n"
            f"_real = _m.{attr}\n"
            f"def _held(*a, **k):\n"
            f"    _p.Path({str(ready)!r}).write_text(str(__import__('os').getpid()))\n"
            f"    _t.sleep({seconds})\n"
            f"    return _real(*a, **k)\n"
            f"_m.{attr} = _held\n")


# A terminal starts a command with Ctrl-C delivered and turned into KeyboardInterrupt, and SIGHUP and
# SIGTERM at their defaults. A child of the test process would inherit that process's state instead: a
# SIGINT another library left ignored or blocked there (both survive fork and exec) would make Ctrl-C
# tests wait out their timeouts, and a test suite started under nohup or in a background job (SIGHUP,
# SIGINT ignored) would start every command as `nohup slmedge` (SIGHUP kept ignored, by design).
TERMINAL_SIGNALS = ("import signal as _s\n_s.pthread_sigmask(_s.SIG_UNBLOCK, {_s.SIGINT, _s.SIGTERM, _s.SIGHUP})\n"
                    "_s.signal(_s.SIGINT, _s.default_int_handler)\n_s.signal(_s.SIGHUP, _s.SIG_DFL)\n"
                    "_s.signal(_s.SIGTERM, _s.SIG_DFL)\n")


def slmedge(args: list[str], cwd: Path, setup: str = "", env: dict | None = None, **kw) -> subprocess.Popen:
    """``slmedge ARGS`` as the command line runs it from a terminal (``main()``), after ``setup``
    (Python source)."""
    code = (f"import sys\n{TERMINAL_SIGNALS}{setup}\nfrom slmedge.cli import main\n"
            f"sys.argv = ['slmedge', *{[str(a) for a in args]!r}]\nmain()\n")
    return subprocess.Popen([sys.executable, "-c", code], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    """Until ``path`` exists; the process ending first is a failure showing its output."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the command ended ({proc.returncode}) before {path.name}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear in {timeout:.0f} s")
        time.sleep(0.05)


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of a process; None when there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[0]


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] not in ("Z", "X")


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, grandchildren...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[1] not in ("Z", "X"):
                children.setdefault(st[0], []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def mentioning(text: str) -> set[int]:
    """Live processes whose command line contains ``text`` (this one excluded)."""
    return {int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid() and alive(int(e))
            and text in cmdline(int(e))}


def kill_and_check(proc: subprocess.Popen, expect: int = 1, marker: str | None = None,
                   within: float = 10.0) -> set[int]:
    """SIGKILL ``proc`` alone (not its process group: what the OOM killer or ``kill -9 PID`` does), once
    it has at least ``expect`` descendants; then every one of them (and every process whose command
    line mentions ``marker``) must be gone ``within`` seconds. Returns the descendants seen."""
    seen = descendants(proc.pid)
    deadline = time.monotonic() + 120
    while len(seen) < expect and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
        seen = descendants(proc.pid)
    assert len(seen) >= expect, f"{proc.pid} has {len(seen)} descendants, expected {expect}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + within
    left = set(seen)
    while time.monotonic() < deadline:
        left = {p for p in seen if alive(p)} | (mentioning(marker) if marker else set())
        if not left:
            return seen
        time.sleep(0.1)
    detail = "; ".join(f"{p}: {cmdline(p)[:160]}" for p in sorted(left))
    for p in left:  # not left running after the test
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise AssertionError(f"alive {within:.0f} s after kill -9 of {proc.pid}: {detail}")


def temp_names(root: Path) -> list[str]:
    """What slmedge's temporary and lock names are left anywhere under ``root``."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.name.startswith((".slmedge-tmp-", ".slmedge-lock-")))
