"""The slmedge command line: one small module per command."""

from __future__ import annotations

import typer

from .common import state
from .compress import compress_command
from .data import data_app
from .evaluate import evaluate_command, lm_eval_command
from .export import export_command, inspect_command
from .methods import methods_command
from .run import run_command
from .study import report_command, study_command
from .targets import targets_app

app = typer.Typer(
    name="slmedge",
    help="Compress small language models, export them to edge runtimes, and measure what was lost and gained.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors.")):
    state.debug = debug


app.command("compress")(compress_command)
app.command("export")(export_command)
app.command("evaluate")(evaluate_command)
app.command("lm-eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                        "help_option_names": []})(lm_eval_command)
app.command("inspect")(inspect_command)
app.command("run")(run_command)
app.command("methods")(methods_command)
app.add_typer(targets_app, name="targets")
app.add_typer(data_app, name="data")
app.command("study")(study_command)
app.command("report")(report_command)


def main() -> None:
    app()
