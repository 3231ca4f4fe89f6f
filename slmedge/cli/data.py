"""slmedge data: the calibration text, corpora and task files shipped with slmedge."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Column

from .common import Table, console, errors_to_exit

DATA_DIR_HELP = ("A folder of the shipped layout (calibration/, perplexity/, tasks/) laid over the shipped data: "
                 "the files it has win, the rest come from slmedge (see `slmedge data`).")

data_app = typer.Typer(help="The data shipped with slmedge: list, verify, path.", invoke_without_command=True,
                       rich_markup_mode=None)


@data_app.callback()
def _data(ctx: typer.Context,
          data_dir: Optional[Path] = typer.Option(None, "--data-dir", envvar="SLMEDGE_DATA_DIR", help=DATA_DIR_HELP)):
    """List the shipped data sets (name, what, items, licence, source); with a --data-dir, which
    files it replaces or adds.

    \b
    Examples:
      slmedge data
      slmedge data verify
      slmedge data path
      slmedge data --data-dir my-data
    """
    if ctx.invoked_subcommand is not None:
        return
    from ..data.files import data_files, index

    with errors_to_exit():
        sets = index()
        files = data_files(data_dir)
    t = Table(Column("name", no_wrap=True), Column("what, and where it comes from", overflow="fold"),
              Column("files", justify="right"), Column("items", justify="right", no_wrap=True),
              Column("MB", justify="right"), Column("licence", max_width=22), title="data shipped with slmedge")
    if files.overlay:
        t.add_column("from --data-dir")
    shipped = set()
    for name, s in sets.items():
        shipped.update(s["files"])
        src = s["source"]
        row = [name, f"{s['what']}\n[dim]{src['repository']} ({src['commit']})[/]", str(len(s["files"])),
               f"{sum(f['items'] for f in s['files'].values()):,}",
               f"{sum(f['bytes'] for f in s['files'].values()) / 1e6:.2f}", s["licence"]]
        if files.overlay:
            replaced = sum(files.origin(rel) == "overlay" for rel in s["files"])
            row.append(f"{replaced} of {len(s['files'])}" if replaced else "-")
        t.add_row(*row)
    console.print(t)
    if files.overlay:
        added = sorted(p.relative_to(files.overlay).as_posix() for p in files.overlay.rglob("*")
                       if p.is_file() and p.relative_to(files.overlay).as_posix() not in shipped)
        console.print(f"--data-dir {files.overlay} adds: {', '.join(added) if added else 'nothing new'}")
    console.print("provenance and licences: README.md in `slmedge data path`; checksums: slmedge data verify")


@data_app.command("verify")
def verify_command():
    """Check every shipped data file against the sha256 recorded when it was packaged.

    \b
    Example:
      slmedge data verify
    """
    from ..data.files import REPAIR, SHIPPED, verify
    from ..errors import DataError

    with errors_to_exit():
        n, problems = verify()
        if problems:
            raise DataError(f"{len(problems)} of {n} shipped data files fail their check: " + "; ".join(problems)
                            + f"; {REPAIR}")
    console.print(f"ok: {n} data files under {SHIPPED} match their recorded sha256", highlight=False, soft_wrap=True)


@data_app.command("path")
def path_command():
    """Print the folder of the shipped data (the layout a --data-dir copies).

    \b
    Example:
      ls "$(slmedge data path)"/tasks
    """
    from ..data.files import SHIPPED

    print(SHIPPED)
