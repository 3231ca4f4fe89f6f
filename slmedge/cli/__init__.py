"""The slmedge command line: one small module per command.

Exit codes (README.md, "Exit codes"): 0 done; 1 a bad or missing input, an output location that
cannot be used, or a failure while working; 2 a bad setting or a usage error; 130 interrupted
(one line, ``interrupted``, wherever the interrupt lands: while the command line's modules load,
while a command parses its options, or while it works); 128 + N stopped by SIGTERM or SIGHUP (one
line, ``terminated (SIGTERM)``, and the same clean-up as an interrupt: ``procs.stop_on_signals``)."""

from __future__ import annotations

import sys

try:
    import typer
    from typer.core import TyperGroup

    from .artifact import artifact_app
    from ..quiet import quiet_libraries, set_debug
    from .common import print_interrupted, state
    from .compress import compress_command
    from .data import data_app
    from .evaluate import evaluate_command, lm_eval_command
    from .export import export_command, imatrix_command, inspect_command
    from .helptext import plain_help
    from .methods import methods_command
    from .run import run_command
    from .study import report_command, study_command
    from .targets import targets_app
except KeyboardInterrupt:  # Ctrl-C while torch and friends import: no traceback
    sys.stderr.write("interrupted\n")
    raise SystemExit(130) from None


class _Group(TyperGroup):
    """The root group: an interrupt anywhere in a command (outside its own error handling too)
    is one line and exit 130, not click's "Aborted!" and 1. Every command's --help is wrapped at
    spaces only (cli/helptext.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        plain_help(self)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            if state.debug:
                raise
            raise typer.Exit(print_interrupted(exc)) from None


app = typer.Typer(
    name="slmedge",
    help="Compress small language models, export them to edge runtimes, and measure what was lost and gained.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    cls=_Group,
)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors.")):
    state.debug = debug
    if debug:
        set_debug()  # the libraries' own notices and warnings stay on, in child processes too
    else:
        quiet_libraries()  # kept out of slmedge's output (slmedge/quiet.py)


app.command("compress")(compress_command)
app.command("export")(export_command)
app.command("imatrix")(imatrix_command)
app.command("evaluate")(evaluate_command)
app.command("lm-eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                        "help_option_names": []})(lm_eval_command)
app.command("inspect")(inspect_command)
app.command("run")(run_command)
app.command("methods")(methods_command)
app.add_typer(targets_app, name="targets")
app.add_typer(data_app, name="data")
app.add_typer(artifact_app, name="artifact")
app.command("study")(study_command)
app.command("report")(report_command)


def main() -> None:
    from ..procs import stop_on_signals

    state.supervise = True  # the command line: evaluate and export run in a supervised child (common.supervised)
    stop_on_signals()  # SIGTERM and SIGHUP stop a command as Ctrl-C does (procs.Stopped)
    try:
        app()
    except KeyboardInterrupt as exc:  # between click's handling and the exit (rare)
        raise SystemExit(print_interrupted(exc)) from None
