"""What every command shares: error translation, the checks every command makes before it starts
work (output locations, model sources), progress bars, the console.

Exit codes (README.md, "Exit codes"): 0 done; 1 a bad or missing input, an output location that
cannot be used, or a failure while working; 2 a bad setting (ConfigError, and click's usage
errors); 130 interrupted; 128 + N stopped by signal N (SIGTERM, SIGHUP: ``procs.Stopped``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import uuid
from pathlib import Path
from typing import Callable, Iterator

import typer
from rich import table as rich_table
from rich.console import Console
from rich.markup import escape

from ..errors import OutputError, OutputExistsError, SlmedgeError, brief
from ..fsutil import disk_full, refuse_replacing, user_paths  # noqa: F401 - user_paths: imported from here too

console = Console()
err_console = Console(stderr=True)


class Table(rich_table.Table):
    """Every table slmedge prints: a cell too long for its column wraps, and a word longer than the
    column (a path, a URL) is folded onto the next line, never cut to "…". Tables are laid out for
    an 80-column terminal; what does not fit there is left to ``--wide`` or ``show`` commands."""

    def __init__(self, *headers, **kwargs):
        super().__init__(*headers, **kwargs)
        self._fold()

    def add_column(self, *args, overflow="fold", **kwargs):
        super().add_column(*args, overflow=overflow, **kwargs)

    def add_row(self, *cells, **kwargs):
        super().add_row(*cells, **kwargs)
        self._fold()  # the columns add_row makes for a table without headers

    def _fold(self) -> None:
        for column in self.columns:
            if column.overflow == "ellipsis":  # rich's default
                column.overflow = "fold"


class State:
    debug = False
    supervise = False  # run evaluate/export in a supervised child (the command line; not under CliRunner)


state = State()


INTERRUPTED = 130

def print_error(message: str) -> None:
    """One ``error:`` line on stderr (temporary names replaced by the user's)."""
    first = " ".join(user_paths(str(message)).split("\n")).strip()
    err_console.print(f"[bold red]error:[/] {escape(first)}", highlight=False, soft_wrap=True)


def print_interrupted(exc: BaseException | None = None) -> int:
    """The one line of a stopped command (``interrupted`` for Ctrl-C, ``terminated (SIGTERM)`` for a
    signal: ``procs.Stopped``); returns its exit code (130, 128 + N)."""
    from ..procs import Stopped, stop_code

    err_console.print(str(exc) if isinstance(exc, Stopped) else "interrupted", highlight=False, soft_wrap=True)
    return stop_code(exc) if exc is not None else INTERRUPTED


@contextlib.contextmanager
def errors_to_exit() -> Iterator[None]:
    """Turn library errors into one line on stderr and a non-zero exit (traceback with --debug):
    ``ConfigError`` exits 2, every other slmedge error and OSError 1, an interrupt 130."""
    try:
        yield
    except typer.Exit:
        raise
    except SlmedgeError as exc:
        if state.debug:
            raise
        print_error(str(exc))
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt as exc:  # Ctrl-C, or procs.Stopped: SIGTERM, SIGHUP
        if state.debug:
            raise
        raise typer.Exit(print_interrupted(exc)) from None
    except OSError as exc:
        if state.debug:
            raise
        if disk_full(exc):  # a write no writer of slmedge's wraps: the path where the library names one
            print_error(f"no space left on {exc.filename or 'the device'}")
            raise typer.Exit(1) from None
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        print_error((exc.strerror or str(exc)) + where)
        raise typer.Exit(1) from None
    except Exception as exc:  # a bug: say so in one line, and how to see more
        if state.debug:
            raise
        if disk_full(exc):  # a library's own error around ENOSPC (safetensors raises SafetensorError)
            print_error("no space left on the device")
            raise typer.Exit(1) from None
        print_error(f"unexpected {type(exc).__name__}: {brief(exc)} "
                    "(run with --debug for the traceback)")
        raise typer.Exit(1) from None


# --- a native crash: one line ----------------------------------------------------------------------


def supervised(command: str) -> None:
    """Run the rest of ``command`` in a child process that a crash in native code (llama.cpp,
    onnxruntime: a segfault ends a process without a word) cannot take the command line down with:
    this process becomes a small supervisor (``slmedge/cli/supervisor.py``, same PID) that passes the
    child's exit code on and, when the child died of a signal, prints one line naming the native code
    and the file it was running, marks the evaluation it was recording as failed, and exits 128 + the
    signal (139 for a segfault). See ``slmedge.procs.supervise``.

    Only where slmedge runs as the command line (``main()``), not under --debug: there a crash shows
    Python's traceback of every thread (faulthandler) instead, and the command runs in this process."""
    if state.debug:
        import faulthandler

        faulthandler.enable()
        return
    if not state.supervise:
        return
    from ..procs import supervise
    from . import supervisor

    outcome = supervise(command, waiter=supervisor.__file__)
    if outcome is None:  # the child: the command goes on here
        state.supervise = False
        return
    supervisor.finish(command, *outcome)  # where the parent could not exec the supervisor: it waited here


# --- checks before any work ------------------------------------------------------------------------


def _flag(default, param: str) -> str:
    """How the user spells a parameter: its longest option name (``--nsamples``), else its name."""
    decls = [d for d in getattr(default, "param_decls", None) or () if d.startswith("--")]
    return max(decls, key=len).split("/")[0] if decls else param.upper()


def bounded(**keys: str):
    """Declare the range of each numeric option of a command (parameter name -> key of
    ``slmedge.limits.LIMITS``) and check them first, before the command's body runs: one ``error:``
    line naming the option, exit 2. tests/test_limits.py holds every numeric option to a key here.
    An option holding a comma-separated list of numbers is checked number by number."""
    from .. import limits

    unknown = [k for k in keys.values() if k not in limits.LIMITS]
    if unknown:
        raise KeyError(f"no range declared for {unknown[0]} in slmedge/limits.py")

    def wrap(fn):
        params = inspect.signature(fn).parameters
        flags = {name: _flag(params[name].default, name) for name in keys}

        @functools.wraps(fn)
        def command(*args, **kwargs):
            with errors_to_exit():
                for name, key in keys.items():
                    value = kwargs.get(name)
                    for v in (number_list(value, flags[name]) if isinstance(value, str) else [value]):
                        limits.check(key, v, flags[name], none=True)
            return fn(*args, **kwargs)

        command.limits = dict(keys)
        return command

    return wrap


def number_list(text: str, option: str) -> list[float]:
    """The numbers of a comma-separated option value ("10,50.5"); ConfigError when one is not a number."""
    from ..errors import ConfigError

    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise ConfigError(f"{option} takes numbers separated by commas, not '{text}'")
    return values


def check_writable_place(path: Path, option: str) -> None:
    """Refuse ``path`` when it could not be created: the nearest folder that exists above it must
    accept a new file (tried with a hidden file, removed at once). Nothing is created."""
    shown = f"{option} {path}" if option else str(path)
    above = Path(os.path.abspath(path)).parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise OutputError(f"cannot write {shown}: {above} is a file, not a folder")
    probe = above / f".slmedge-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError as exc:
        reason = "no space left on the device" if disk_full(exc) else (exc.strerror or str(exc)).lower()
        raise OutputError(f"cannot write {shown}: {above} does not take new files ({reason})") from None
    os.close(fd)
    probe.unlink(missing_ok=True)


def check_output_dir(path: Path, *, option: str = "-o", overwrite: bool = False, manifest: str | None = None,
                     inputs=(), what: str = "the output") -> Path:
    """A folder output (an artifact, an ONNX export): not a file, not an input, replaceable under the
    command's rules (non-empty only with --overwrite, and then only what slmedge wrote: ``manifest``),
    and creatable. Nothing is written."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputExistsError(f"{option} {path} is a file; {what} is a folder: give a folder path")
    refuse_replacing(path, overwrite, manifest, inputs)
    check_writable_place(path, option)
    return path


def check_output_file(path: Path, *, option: str = "-o", overwrite: bool | None = False, inputs=(),
                      ours: Callable[[Path], bool] | None = None, what: str = "the output", example: str = "",
                      ours_noun: str = "a file") -> Path:
    """A one-file output (a GGUF export, a JSON or report file): not a folder, not an input, and
    creatable. ``overwrite``: None when the command replaces the file anyway; False: an existing
    file is refused (pass --overwrite); True: replaced when ``ours`` says slmedge wrote it."""
    path = Path(path)
    for src in inputs:
        if src is not None and Path(src).exists() and Path(src).resolve() == path.resolve():
            raise OutputExistsError(f"{option} {path} is the input; choose another output")
    if path.is_dir():
        eg = f" (such as {path / example})" if example else ""
        raise OutputExistsError(f"{option} {path} is a folder, and {what} is one file: {option} must be a file path{eg}")
    if path.exists() and overwrite is not None:
        # --overwrite is advised only where it would then work: never over what slmedge did not write.
        if ours is not None and not ours(path):
            raise OutputExistsError(f"{option} {path} is not {ours_noun} slmedge wrote; --overwrite only replaces "
                                    "slmedge's own outputs: choose another output")
        if not overwrite:
            raise OutputExistsError(f"{option} {path} exists; pass --overwrite to replace it")
    check_writable_place(path, option)
    return path


def check_model(spec, revision: str | None = None, trust_remote_code: bool = False):
    """Resolve a model source before anything is written (a missing one leaves no output folder):
    returns its ModelSource; a missing or unreachable one raises ModelNotFoundError, one whose files
    name code to run RemoteCodeError (unless ``trust_remote_code``)."""
    from ..models.source import resolve

    return resolve(spec, revision, trust_remote_code)


@contextlib.contextmanager
def progress_bar(enabled: bool = True):
    """The command's progress on stderr (``slmedge.progress``: live bars on a terminal, a plain line
    per stage elsewhere); yields the reporter, also the library's ``callback(stage, done, total)``."""
    from .. import progress

    with progress.reporter(enabled) as rep:
        yield rep


def given_options(*names: str) -> set[str] | None:
    """Which of the running command's parameters ``names`` were given (on the command line or by an
    environment variable), not left at their defaults; None outside a command (then a recipe judges
    by value: ``Recipe.validate``)."""
    import importlib

    ctx = None
    for package in ("typer._click", "click"):  # typer 0.2x runs its own copy of click; earlier ones click
        try:
            ctx = importlib.import_module(f"{package}.globals").get_current_context(silent=True)
        except ImportError:
            continue
        if ctx is not None:
            break
    if ctx is None:
        return None
    sources = {n: ctx.get_parameter_source(n) for n in names}
    return {n for n, source in sources.items() if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")}
