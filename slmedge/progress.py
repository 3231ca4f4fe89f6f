"""Progress of long work, on stderr: what stage runs, how many of its items are done, how long it has
taken and how long it has left.

The commands open one reporter (``reporter()``) around their work; the work reports into it in one
of two ways:

- ``with progress.stage("export tensors", total=n) as p: ... p.advance()`` anywhere below a command
  (a no-op where no reporter is open: the library API is quiet unless its caller opens one);
- the callback the library's long functions take (``progress(name, done, total)``): the reporter
  itself is one.

``with rep.section("compress"):`` names a part of a command; its stages are shown under it.

``SLMEDGE_PROGRESS`` chooses: ``auto`` (the default: bars on a terminal, lines elsewhere), ``bar``,
``lines`` or ``off``.

On a terminal the open stages are live bars (stage, a bar, done/total, elapsed, remaining) that
go when they finish, and each section leaves one line when it ends. Elsewhere (a log, CI, a pipe)
each stage writes one plain line when it finishes (``compress: block 30/30 in 1m 12s``), and one
line every ``every_s`` seconds while it runs (with the time left), so that a log shows the work
moving. Nothing is written to stdout, where commands put their JSON.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Iterator, TextIO

__all__ = ["Reporter", "Stage", "active", "format_seconds", "reporter", "stage"]

_active: "Reporter | None" = None
MODES = ("bar", "lines", "off")  # SLMEDGE_PROGRESS; anything else (auto): bar on a terminal, else lines


def active() -> "Reporter | None":
    """The reporter a command opened, or None (the library API, quiet)."""
    return _active


def format_seconds(seconds: float) -> str:
    """4.2s, 1m 12s, 1h 03m."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(round(seconds)), 60)
    if m < 60:
        return f"{m}m {s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m"


class Stage:
    """One stage's count: ``advance()`` an item, or ``update(done, total)``. Without a reporter it
    only counts."""

    def __init__(self, rep: "Reporter | None", name: str, total: int | None):
        self.rep, self.name, self.total, self.done = rep, name, total, 0
        self.started = self.last_line = time.monotonic()
        self.finished = False
        self.task = None  # the rich task id on a terminal

    def advance(self, n: int = 1) -> None:
        self.update(self.done + n)

    def update(self, done: int, total: int | None = None) -> None:
        if total is not None:
            self.total = total
        self.done = done
        if self.rep is not None:
            self.rep._updated(self)

    def finish(self, quiet: bool = False) -> None:
        """The stage is over (every item done, or the work stopped counting): its line, once
        (``quiet``: none, the stage failed)."""
        if self.rep is not None and not self.finished:
            self.rep._finished(self, quiet)
        self.finished = True


class Reporter:
    """What a command shows of its work; see the module's text. ``mode``: "bar" (rich's live bars),
    "lines" (plain lines) or "off"."""

    def __init__(self, mode: str, stream: TextIO | None = None, every_s: float = 30.0, console=None):
        self.mode, self.every_s = mode, every_s
        self._stream = stream
        self._lock = threading.RLock()
        self._stages: dict[str, Stage] = {}
        self._prefix: list[str] = []
        self._progress = None
        # When the last stage ended or began: where a stage first heard of at its first item done
        # (the library's callback reports items as they finish) began its work.
        self._mark = time.monotonic()
        if mode == "bar":
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            console = console or Console(file=stream, stderr=stream is None)
            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(bar_width=24), TextColumn("{task.fields[count]}"),
                TimeElapsedColumn(), _remaining_column(), console=console, transient=True,
                # stdout is moved above the bars only where it is the same terminal, never into stderr
                redirect_stdout=sys.stdout.isatty(), redirect_stderr=False)

    # --- a command's parts ------------------------------------------------------------------------

    def __enter__(self) -> "Reporter":
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            for st in list(self._stages.values()):
                st.finish(quiet=True)  # left open: the work failed or stopped counting before its total
            self._stages.clear()
        if self._progress is not None:
            self._progress.stop()

    @contextlib.contextmanager
    def section(self, label: str, total: int | None = None) -> Iterator[Stage]:
        """A named part of a command (``compress``, ``evaluate base``): its stages are named under it,
        and it leaves one line when it ends (``compress: done in 3m 02s``)."""
        self._line(f"{label} ...")
        st = self._open(label, total, shown=self.mode == "bar")
        self._prefix.append(label)
        try:
            yield st
        finally:
            self._prefix.pop()
            with self._lock:
                for name in [n for n in self._stages if n.startswith(label + ": ")]:
                    self._stages[name].finish(quiet=True)  # what its work left open (it failed, or stopped counting)
                self._close_task(st)
                self._stages.pop(label, None)
                st.finished = True
        self._permanent(f"{label}: done in {format_seconds(time.monotonic() - st.started)}")

    def stage(self, name: str, total: int | None = None) -> Stage:
        """A new stage of this name (one left open under the same name is finished first)."""
        full = self._full(name)
        with self._lock:
            old = self._stages.get(full)
            if old is not None:
                old.finish()
            return self._open(full, total)

    def __call__(self, name: str, done: int, total: int) -> None:
        """The library's callback: stage ``name`` has ``done`` of ``total`` items done. A count that
        starts again (lower than the last) is a new stage of the same name."""
        full = self._full(name)
        with self._lock:
            st = self._stages.get(full)
            if st is None or st.finished or done < st.done:
                began = self._mark
                st = self.stage(name, total)
                if done > 0:  # its first items were done before this call: its work began at the mark
                    st.started = st.last_line = began
                    if st.task is not None:  # the bar's clock too (rich's monotonic clock, as ours)
                        self._progress._tasks[st.task].start_time = began
            st.update(done, total)

    # --- inside -----------------------------------------------------------------------------------

    def _full(self, name: str) -> str:
        return ": ".join([*self._prefix, name]) if self._prefix else name

    def _open(self, full: str, total: int | None, shown: bool = True) -> Stage:
        st = Stage(self, full, total)
        with self._lock:
            self._mark = st.started
            self._stages[full] = st
            if self._progress is not None and shown:
                indent = "  " * len(self._prefix)
                st.task = self._progress.add_task(indent + full.split(": ")[-1], total=total, count="")
                self._render(st)
        return st

    def _updated(self, st: Stage) -> None:
        with self._lock:
            if st.finished:
                return
            if self._progress is not None:
                self._render(st)
            elif self.mode == "lines" and st.total and st.done < st.total:
                now = time.monotonic()
                if now - st.last_line >= self.every_s:
                    st.last_line = now
                    elapsed = now - st.started
                    left = elapsed / st.done * (st.total - st.done) if st.done else None
                    self._line(f"{st.name} {st.done}/{st.total}, {format_seconds(elapsed)} so far"
                               + (f", about {format_seconds(left)} left" if left is not None else ""))
            if st.total and st.done >= st.total:
                st.finish()

    def _render(self, st: Stage) -> None:
        if st.task is None:
            return
        count = f"{st.done}/{st.total}" if st.total else (f"{st.done}" if st.done else "")
        self._progress.update(st.task, completed=st.done, total=st.total, count=count)

    def _finished(self, st: Stage, quiet: bool = False) -> None:
        with self._lock:
            self._mark = time.monotonic()
            if self._stages.get(st.name) is st:
                del self._stages[st.name]
            if self._progress is not None and st.task is not None and not quiet:
                self._render(st)
                self._progress.refresh()  # its last count is seen, however short it was
            self._close_task(st)
            if self.mode == "lines" and not quiet:
                count = f" {st.done}/{st.total}" if st.total else ""
                self._line(f"{st.name}{count} in {format_seconds(time.monotonic() - st.started)}")

    def _close_task(self, st: Stage) -> None:
        if self._progress is not None and st.task is not None:
            self._progress.remove_task(st.task)
            st.task = None

    def _line(self, text: str) -> None:
        if self.mode == "lines":
            stream = self._stream or sys.stderr
            stream.write(text + "\n")
            stream.flush()

    def _permanent(self, text: str) -> None:
        """A line that stays: above the bars on a terminal, a plain line elsewhere."""
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            self._line(text)


def _remaining_column():
    """The time left at the stage's pace so far (``about 1:02 left``); nothing before the first item,
    nor for a stage without a count."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Remaining(ProgressColumn):
        def render(self, task) -> Text:
            if not task.total or not task.completed or task.finished:
                return Text("")
            elapsed = task.elapsed or 0.0
            left = elapsed / task.completed * (task.total - task.completed)
            return Text(f"about {format_seconds(left)} left", style="progress.remaining")

    return Remaining()


@contextlib.contextmanager
def reporter(enabled: bool = True, *, mode: str | None = None, stream: TextIO | None = None, every_s: float = 30.0,
             console=None) -> Iterator[Reporter | None]:
    """Open the command's reporter (yields it; None when ``enabled`` is false or SLMEDGE_PROGRESS is
    ``off``, and then nothing is shown): live bars where stderr (or ``stream``) is a terminal, plain lines elsewhere. A reporter
    opened inside another yields the outer one (a command that runs another's work)."""
    global _active
    if not enabled:
        yield None
        return
    if _active is not None:
        yield _active
        return
    if mode is None:
        mode = os.environ.get("SLMEDGE_PROGRESS", "auto").strip().lower()
        if mode not in MODES:
            out = stream or sys.stderr
            mode = "bar" if getattr(out, "isatty", lambda: False)() else "lines"
    if mode == "off":
        yield None
        return
    with Reporter(mode, stream, every_s, console) as rep:
        _active = rep
        try:
            yield rep
        finally:
            _active = None


@contextlib.contextmanager
def stage(name: str, total: int | None = None) -> Iterator[Stage]:
    """A stage of the open reporter (a stage that only counts where none is open). It ends with the
    block, if it has not ended by counting its last item."""
    st = _active.stage(name, total) if _active is not None else Stage(None, name, total)
    try:
        yield st
    except BaseException:
        st.finish(quiet=True)
        raise
    st.finish()


@contextlib.contextmanager
def section(label: str) -> Iterator[None]:
    """A section of the open reporter (nothing where none is open)."""
    if _active is None:
        yield
        return
    with _active.section(label):
        yield
