#!/usr/bin/env python
"""Benchmark: a study end to end on SmolLM2-135M — wall time, jobs per minute, what sharing
artifacts saved against running every evaluation's chain alone — and the seed study's findings
checked one by one on whatever the store holds.

    .venv/bin/python benchmarks/study.py                          # the quick study (~30 min, 2 cores)
    .venv/bin/python benchmarks/study.py --study scripts/studies/seed.toml   # the seed grid (hours; resumable)
    .venv/bin/python benchmarks/study.py --study scripts/studies/seed.toml --models smollm2-135m
    .venv/bin/python benchmarks/study.py --study scripts/studies/seed.toml --findings-only   # both models, run nothing

Findings checked per model (the seed study's claims): quantization ahead of pruning on fidelity
(mean KL, top-1), on multilingual perplexity (geometric mean over corpora) and on task accuracy
(mean over tasks), overall and INT4 against 50% / 2:4 sparsity; Wanda against SparseGPT at each
sparsity; and the methods ranked by each metric (does a single metric mislead?); then size and
speed: each family's files per target and what sparsity gained in each export format. Each is
printed with its numbers, followed by the "best under N MB / above M tokens/s" tables and the job
time per kind (compress, export, evaluate).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def findings(rows: list[dict]) -> list[str]:
    """The seed study's claims against these rows, then size and speed (slmedge.study.report)."""
    from slmedge.study.report import findings as report_findings

    return report_findings(rows)


def print_per_model(rows) -> None:
    from slmedge.study.report import best_under

    for model in dict.fromkeys(r["labels"].get("model") for r in rows):  # each model's grid on its own
        mine = [r for r in rows if r["labels"].get("model") == model]
        print(f"{model}: {len(mine)} evaluations")
        for line in findings(mine):
            print("  " + line)
        for table in best_under(mine):
            print(f"  {table['title']}:")
            print("    " + " | ".join(table["columns"]))
            for row in table["rows"]:
                print("    " + " | ".join(str(c) for c in row))


def print_time_by_kind(store, study: str) -> None:
    """Job time per kind over the grid as it stands (every run that finished a job of it)."""
    rows = store.db.execute("SELECT kind, COUNT(*), SUM(seconds) FROM study_jobs WHERE study = ? AND in_grid = 1 "
                            "AND status = 'done' GROUP BY kind", (study,)).fetchall()
    print("job time by kind (the grid's finished jobs): " + "; ".join(
        f"{kind} {n} job(s) {secs or 0:.0f} s ({(secs or 0) / n:.0f} s each)" for kind, n, secs in rows))


def print_findings_only(study, store, wd: Path) -> int:
    from slmedge.study.engine import StudyStore
    from slmedge.study.jobs import build_jobs
    from slmedge.study.report import load_rows, write_report

    jobs = build_jobs(study, wd / "work")
    StudyStore(store).register(study.name, jobs)  # the current grid: nothing runs
    rows = load_rows(store, study.name)
    wanted = sum(1 for j in jobs if j.kind == "evaluate")
    print(f"study {study.name}: {len(rows)} of {wanted} evaluations finished (nothing run now)")
    print_per_model(rows)
    report = wd / f"{study.name}.html"
    write_report(store, report, "html", study.name, overwrite=True)  # its own report of the last run
    print(f"report: {report}")
    store.close()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", type=Path, default=ROOT / "scripts" / "studies" / "quick.toml")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "study")
    ap.add_argument("--fresh", action="store_true", help="Start from nothing (else resume).")
    ap.add_argument("--engine", default="local")
    ap.add_argument("--models", help="Run only these of the study's models (comma-separated); the report and "
                                     "findings cover what the store holds for the study.")
    ap.add_argument("--findings-only", action="store_true",
                    help="Run nothing: take the study file (and --models) as the current grid and print the "
                         "findings of its finished evaluations (a partial grid, or a grid run model by model).")
    args = ap.parse_args()
    import shutil

    from slmedge.evaluate.store import ResultsStore
    from slmedge.study.engine import run_study
    from slmedge.study.report import load_rows, write_report
    from slmedge.study.spec import load_study

    study = load_study(args.study)
    if args.models:
        import dataclasses

        wanted = args.models.split(",")
        unknown = [m for m in wanted if m not in study.models]
        if unknown:
            sys.exit(f"--models: {', '.join(unknown)} not in {args.study} (it has {', '.join(study.models)})")
        study = dataclasses.replace(study, models=wanted)
    wd = args.workdir / study.name
    if args.fresh:
        shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True, exist_ok=True)
    store = ResultsStore(wd / "results.sqlite")
    if args.findings_only:
        return print_findings_only(study, store, wd)
    t = time.perf_counter()
    counts = run_study(study, store, engine=args.engine, workdir=wd / "work",
                       progress=lambda j, c, left: print(f"[{time.strftime('%H:%M:%S')}] {j.kind} {j.id} done, "
                                                         f"{left} left", file=sys.stderr, flush=True))
    wall = time.perf_counter() - t
    jobs = store.db.execute("SELECT job_id, kind, deps, seconds FROM study_jobs WHERE study = ? AND in_grid = 1", (study.name,)).fetchall()
    secs = {j: s or 0.0 for j, _, _, s in jobs}
    deps = {j: json.loads(d) for j, _, d, _ in jobs}

    def chain(j):  # the job and everything it needs, as if run alone
        return secs[j] + sum(chain(d) for d in deps[j])

    shared = sum(secs.values())
    alone = sum(chain(j) for j, k, _, _ in jobs if k == "evaluate")
    report = wd / f"{study.name}.html"
    write_report(store, report, "html", study.name, overwrite=True)  # its own report of the last run
    rows = load_rows(store, study.name)
    print(f"\nstudy {study.name}: {counts['jobs']} jobs ({counts['ran']} run now, {counts['already_done']} done before); "
          f"wall {wall:.0f} s, {counts['ran'] / max(wall / 60, 1e-9):.2f} jobs/min")
    print(f"job time with sharing {shared:.0f} s; every evaluation's chain alone {alone:.0f} s; "
          f"sharing saved {alone - shared:.0f} s ({1 - shared / alone:.0%})" if alone else "")
    print_time_by_kind(store, study.name)
    print_per_model(rows)
    print(f"report: {report}")
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
