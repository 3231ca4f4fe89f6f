"""The supervising parent of ``slmedge evaluate``, ``export`` and ``run`` (``common.supervised``).

The command line forks: the child runs the command; the parent execs this file (same PID, still the
child's parent, the shell's job): ``python -S supervisor.py PID FD COMMAND PACKAGE_ROOT``. Run by path,
it loads only ``slmedge.procs`` and the standard library (~10 MB), so the supervisor does not keep the
command line's own memory (torch and friends, and every page the child changes after the fork) for
as long as the command runs. It waits for the child (``procs.wait_for_child``), passes its exit code
on, and when the child died of a signal prints the one line ``procs.crash_message`` writes and marks
the run the child was recording in the results store as failed with it.
"""

from __future__ import annotations

import os
import sys


def say(message: str) -> None:
    """The ``error:`` line, as ``common.print_error`` prints it (without loading rich)."""
    from slmedge.fsutil import user_paths

    line = " ".join(user_paths(message).split("\n")).strip()
    tag = "\x1b[1;31merror:\x1b[0m" if sys.stderr.isatty() else "error:"
    sys.stderr.write(f"{tag} {line}\n")
    sys.stderr.flush()


def fail_recorded_run(notes: dict, message: str) -> None:
    """The results store's run the child was recording (``procs.note("run", ...)``), marked failed with
    ``message``; only a run still 'running'. Loads the store's module (and torch with it) only now."""
    run = notes.get("run")
    if not run:
        return
    try:
        import site

        site.main()  # started with -S: the installed packages the store's module imports
        from slmedge.evaluate.store import ResultsStore

        store = ResultsStore(run[0])
        try:
            if (store.run_status(int(run[1])) or ("",))[0] == "running":
                store.end_run(int(run[1]), error=message)
        finally:
            store.close()
    except Exception:  # noqa: BLE001 - the line was said; a store that cannot be written stays as it is
        pass


def finish(command: str, code: int, died: dict | None) -> None:
    """Say what the child's death was (if it died of a signal), and end with its code."""
    if died is not None:
        from slmedge.procs import crash_message

        message = crash_message(command, died)
        say(message)
        fail_recorded_run(died.get("notes") or {}, message)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)  # nothing here to tear down


def main(argv: list[str]) -> None:
    pid, fd, command, root = int(argv[1]), int(argv[2]), argv[3], argv[4]
    sys.path[0] = root  # the slmedge the command line ran, not this file's folder
    import mmap

    from slmedge.procs import SLOT_BYTES, wait_for_child

    slot = mmap.mmap(fd, SLOT_BYTES)
    finish(command, *wait_for_child(pid, slot))


if __name__ == "__main__":
    main(sys.argv)
