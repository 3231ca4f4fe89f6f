"""What every command shares: error translation, progress bars, the console."""

from __future__ import annotations

import contextlib
import errno
import sys
from typing import Iterator

import typer
from rich.markup import escape
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..errors import SlmedgeError
from ..fsutil import disk_full

console = Console()
err_console = Console(stderr=True)


class State:
    debug = False


state = State()


@contextlib.contextmanager
def errors_to_exit() -> Iterator[None]:
    """Turn library errors into one line on stderr and a non-zero exit (traceback with --debug)."""
    try:
        yield
    except typer.Exit:
        raise
    except SlmedgeError as exc:
        if state.debug:
            raise
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        if state.debug:
            raise
        err_console.print("[bold red]interrupted:[/] nothing half-written was left behind", soft_wrap=True)
        raise typer.Exit(130) from None
    except OSError as exc:
        if state.debug:
            raise
        reason = "no space left on the device" if exc.errno == errno.ENOSPC else exc.strerror or str(exc)
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        err_console.print(f"[bold red]error:[/] {escape(reason + where)}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except Exception as exc:  # a bug: say so in one line, and how to see more
        if state.debug:
            raise
        if disk_full(exc):  # a library's own error around ENOSPC (safetensors raises SafetensorError)
            err_console.print("[bold red]error:[/] no space left on the device", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        first = (str(exc).splitlines() or [""])[0][:300]
        err_console.print(f"[bold red]error:[/] unexpected {type(exc).__name__}: {first} (run with --debug for the traceback)",
                          highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


@contextlib.contextmanager
def progress_bar(enabled: bool = True):
    """A rich progress bar; yields ``callback(task, done, total)``."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as progress:
        tasks: dict[str, int] = {}

        def update(name: str, done: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = progress.add_task(name, total=total)
            progress.update(tasks[name], completed=done, total=total)

        yield update
