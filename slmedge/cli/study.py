"""slmedge study / slmedge report."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import Table, bounded, check_writable_place, console, errors_to_exit, number_list
from .data import DATA_DIR_HELP


@bounded(workers="workers")
def study_command(
    study_file: Path = typer.Argument(..., help="The study's TOML file (see scripts/studies/)."),
    engine: str = typer.Option("local", "--engine", help="local (a process pool on this machine) or ray."),
    address: Optional[str] = typer.Option(None, "--address", help="Ray: the address of an existing cluster "
                                          "(default: start Ray locally)."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Jobs at once (default: cores / threads per job)."),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="Where artifacts and exports go "
                                           "(default: the study's workdir, else the user cache)."),
    results_db: Optional[Path] = typer.Option(None, "--results-db", envvar="SLMEDGE_RESULTS_DB",
                                              help="SQLite results store (default: user data dir)."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", envvar="SLMEDGE_DATA_DIR", help=DATA_DIR_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and list the jobs; run nothing."),
    discard_artifacts: bool = typer.Option(False, "--discard-artifacts", help="Delete each compressed model and "
                                           "export once every job that needs it has finished (results stay in the "
                                           "store; one a later job needs is rebuilt)."),
):
    """Run a study's grid: compress -> export -> evaluate, each job once, resumable.

    \b
    Examples:
      slmedge study scripts/studies/quick.toml
      slmedge study scripts/studies/seed.toml --engine ray
      slmedge report -o report.html
    """
    from ..evaluate.store import ResultsStore
    from ..study.engine import StudyStore, check_engine, run_study
    from ..study.jobs import build_jobs, study_workdir
    from ..study.spec import load_study

    with errors_to_exit():
        check_engine(engine, workers)
        study = load_study(study_file)
        wd = study_workdir(study, workdir)
        # A workdir that cannot be one is refused before the plan is shown and the store is opened.
        shown = f"--workdir {wd}" if workdir else f"the study's workdir {wd}"
        if wd.exists() and not wd.is_dir():
            from ..errors import OutputError

            raise OutputError(f"{shown} is a file; a study's workdir is a folder: give a folder path")
        check_writable_place(wd, "--workdir" if workdir else "the study's workdir")
        jobs = build_jobs(study, wd, str(data_dir) if data_dir else None)  # every input found and hashed
        kinds = {k: sum(j.kind == k for j in jobs) for k in ("compress", "export", "evaluate")}
        console.print(f"study {study.name}: {len(jobs)} jobs ({kinds['compress']} compress, {kinds['export']} export, "
                      f"{kinds['evaluate']} evaluate), workdir {wd}")
        if dry_run:
            t = Table("job", "kind", "what", "after")
            for j in jobs:
                t.add_row(j.id, j.kind, " · ".join(str(j.labels[k]) for k in ("model", "method", "export", "target")
                                                   if j.labels.get(k) not in (None, "", "none")),
                          ", ".join(j.deps))
            console.print(t)
            return
        store = ResultsStore(results_db)
        try:
            done_before = len(StudyStore(store).finished(study.name).keys() & {j.id for j in jobs})
            if done_before:
                console.print(f"resuming: {done_before} job(s) already finished")

            import sys
            import time

            from ..progress import format_seconds
            from .common import progress_bar

            started = time.monotonic()

            def progress(job, counts, left):
                done = counts['ran'] + counts['reused'] + counts['already_done']
                elapsed = time.monotonic() - started
                # the time left at this run's pace so far (the jobs finished before it took none of it)
                pace = elapsed / (done - done_before) if done > done_before else None
                eta = f", about {format_seconds(pace * left)} left" if pace is not None and left else ""
                console.print(f"[{done}/{counts['jobs']}] {job.kind} {job.id} done ({left} left, {counts['failed']} "
                              f"failed; {format_seconds(elapsed)} so far{eta})", markup=False, highlight=False)
                if reporter is not None:
                    reporter("jobs", done, counts["jobs"])

            # a live bar of the jobs on a terminal; elsewhere the line per job above is the progress
            with progress_bar(enabled=sys.stderr.isatty()) as reporter:
                counts = run_study(study, store, engine=engine, workers=workers, address=address, workdir=workdir,
                                   data_dir=str(data_dir) if data_dir else None, progress=progress,
                                   discard_artifacts=discard_artifacts)
        finally:
            store.close()
        per_min = counts["ran"] / (counts["seconds"] / 60) if counts["seconds"] > 0 else 0.0
        extra = f", {counts['rebuilt']} of them rebuilt (their output was gone)" if counts["rebuilt"] else ""
        if counts["discarded_bytes"]:
            extra += f", {counts['discarded_bytes'] / 1e9:.2f} GB of artifacts no job needs any more discarded"
        if counts.get("inputs_changed"):
            extra += (f", {sum(counts['inputs_changed'].values())} of them because what they read changed since "
                      "they last ran (" + ", ".join(f"{n} {k}" for k, n in counts["inputs_changed"].items())
                      + "; the earlier results are kept, out of the grid)")
        console.print(f"study {study.name}: {counts['ran']} job(s) run{extra}, {counts['already_done']} already done, "
                      f"{counts['reused']} adopted from disk, in {counts['seconds']:.0f} s ({per_min:.1f} jobs/min); "
                      f"results in {store.path} — slmedge report --study {study.name} -o report.html")
        spent = [(k, counts["ran_by_kind"][k], t) for k, t in counts["seconds_by_kind"].items() if counts["ran_by_kind"][k]]
        if spent:
            console.print("job time by kind: " + "; ".join(f"{k} {n} job(s), {t:.0f} s ({t / n:.0f} s each)"
                                                          for k, n, t in spent), markup=False, highlight=False)


@bounded(under_mb="under_mb", above_tps="above_tps")
def report_command(
    store_path: Optional[Path] = typer.Argument(None, help="Results store (default: $SLMEDGE_RESULTS_DB or the user data dir); "
                                                "read only, never created or changed."),
    output: Path = typer.Option(Path("report.html"), "-o", "--output", help="Report file."),
    fmt: str = typer.Option("html", "--format", help="html (one self-contained file) or md (plots beside it)."),
    study: Optional[str] = typer.Option(None, "--study", help="Only this study's evaluations."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing report (only one slmedge wrote; "
                                   "any other file is refused)."),
    under_mb: Optional[str] = typer.Option(None, "--under-mb", help="Size budgets of the 'best under N MB' tables, "
                                           "comma-separated (default: the smallest, median and largest file)."),
    above_tps: Optional[str] = typer.Option(None, "--above-tps", help="Decode speeds of the 'best above M tokens/s' "
                                            "tables, comma-separated (default: the slowest, median and fastest)."),
):
    """Turn the results store into tables, plots and caveats a person reads.

    Evaluations that failed or did not finish are left out (the report says how many).

    \b
    Examples:
      slmedge report -o report.html
      slmedge report results.sqlite --study quick --format md -o report.md
      slmedge report --study quick -o report.html --overwrite
    """
    from ..errors import ConfigError
    from ..evaluate.store import ResultsStore
    from ..study.report import write_report

    with errors_to_exit():
        if fmt not in ("html", "md"):
            raise ConfigError(f"--format is html or md, not {fmt}")
        budgets = number_list(under_mb, "--under-mb") if under_mb is not None else None  # ranges: @bounded
        speeds = number_list(above_tps, "--above-tps") if above_tps is not None else None
        check_writable_place(output, "-o")  # missing folders above it are created when it is written
        store = ResultsStore(store_path, readonly=True)
        try:
            info = write_report(store, output, fmt, study, overwrite=overwrite, budgets_mb=budgets, min_tps=speeds)
        finally:
            store.close()
        left = f" ({info['left_out']} that failed or did not finish left out)" if info.get("left_out") else ""
        console.print(f"report: {info['rows']} evaluations{left} -> {info['path']}")
