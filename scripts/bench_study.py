#!/usr/bin/env python
"""Benchmark: a study end to end on SmolLM2-135M — wall time, jobs per minute, what sharing
artifacts saved against running every evaluation's chain alone — and the seed study's findings
checked one by one on whatever the store holds.

    .venv/bin/python scripts/bench_study.py                          # the quick study (~30 min, 2 cores)
    .venv/bin/python scripts/bench_study.py --study scripts/studies/seed.toml   # the seed grid (hours; resumable)
    .venv/bin/python scripts/bench_study.py --study scripts/studies/seed.toml --models smollm2-135m
    .venv/bin/python scripts/bench_study.py --study scripts/studies/seed.toml --findings-only   # both models, run nothing

Findings checked per model (the seed study's claims): quantization ahead of pruning on fidelity
(mean KL, top-1), on multilingual perplexity (geometric mean over corpora) and on task accuracy
(mean over tasks), overall and INT4 against 50% / 2:4 sparsity; Wanda against SparseGPT at each
sparsity; and the methods ranked by each metric (does a single metric mislead?). Each is printed
with its numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def mean(values):
    v = [x for x in values if x is not None]
    return sum(v) / len(v) if v else None


def gmean(values):
    v = [x for x in values if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else None


KIND = {"gptq": "quant", "awq": "quant", "rtn": "quant", "sparsegpt": "prune", "wanda": "prune", "magnitude": "prune"}
# metric, label, lower is better, how the subsets (languages, tasks) are combined
METRICS = (("kl_mean", "fidelity (mean KL to the base)", True, mean),
           ("top1_agreement", "fidelity (top-1 agreement)", False, mean),
           ("perplexity", "multilingual perplexity (geometric mean over corpora)", True, gmean),
           ("acc", "task accuracy (mean over tasks)", False, mean))


def score(row, metric, how):
    return how(list(row["metrics"].get(metric, {}).values()))


def findings(rows: list[dict]) -> list[str]:
    """The seed study's claims against these rows (torch artifacts and exports alike)."""
    def agg(group, metric, how):
        return mean([score(r, metric, how) for r in group])

    out = []
    quant = [r for r in rows if KIND.get(r["labels"].get("method_name")) == "quant"]
    prune = [r for r in rows if KIND.get(r["labels"].get("method_name")) == "prune"]
    if quant and prune:
        for metric, label, lower, how in METRICS:
            q, p = agg(quant, metric, how), agg(prune, metric, how)
            if q is None or p is None:
                continue
            holds = q < p if lower else q > p
            out.append(f"quantization ahead of pruning on {label}: quantized {q:.4g} vs pruned {p:.4g} -> "
                       f"{'holds' if holds else 'does NOT hold'}")
        # At a like compression: INT4 against 50% sparsity (unstructured and 2:4).
        q4 = [r for r in quant if r["labels"].get("bits") == 4]
        p50 = [r for r in prune if str(r["labels"].get("sparsity")) in ("0.5", "2:4")]
        if q4 and p50:
            parts = []
            for metric, label, lower, how in METRICS:
                q, p = agg(q4, metric, how), agg(p50, metric, how)
                if q is not None and p is not None:
                    parts.append(f"{metric} {q:.4g} vs {p:.4g} ({'quant' if (q < p) == lower else 'prune'} ahead)")
            out.append("INT4 vs 50% / 2:4 sparsity: " + "; ".join(parts))
    # Wanda against SparseGPT, setting by setting.
    for sparsity in ("0.5", "0.75", "2:4"):
        w = [r for r in rows if r["labels"].get("method_name") == "wanda" and str(r["labels"].get("sparsity")) == sparsity]
        s = [r for r in rows if r["labels"].get("method_name") == "sparsegpt" and str(r["labels"].get("sparsity")) == sparsity]
        if w and s:
            parts, wins = [], 0
            for metric, label, lower, how in METRICS:
                a, b = agg(w, metric, how), agg(s, metric, how)
                if a is not None and b is not None:
                    better = (a < b) == lower
                    wins += better
                    parts.append(f"{metric} {a:.4g} vs {b:.4g}")
            out.append(f"Wanda vs SparseGPT at sparsity {sparsity}: " + "; ".join(parts) +
                       f" -> Wanda ahead on {wins} of {len(parts)}")
    # A single metric misleads: the methods ranked by each metric.
    methods = sorted({r["labels"].get("method") for r in rows if r["labels"].get("method_name") in KIND})
    if len(methods) > 2:
        ranks = {}
        for metric, label, lower, how in METRICS:
            vals = {m: agg([r for r in rows if r["labels"].get("method") == m], metric, how) for m in methods}
            if all(v is not None for v in vals.values()):
                ranks[metric] = sorted(methods, key=lambda m: vals[m] if lower else -vals[m])
        for metric, order in ranks.items():
            out.append(f"ranked by {metric}: " + " > ".join(order))
        if len({tuple(o) for o in ranks.values()}) > 1:
            out.append("the metrics rank the methods differently (a single metric misleads)")
    return out


def print_per_model(rows) -> None:
    for model in dict.fromkeys(r["labels"].get("model") for r in rows):  # each model's grid on its own
        mine = [r for r in rows if r["labels"].get("model") == model]
        print(f"{model}: {len(mine)} evaluations")
        for line in findings(mine):
            print("  " + line)


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
    print_per_model(rows)
    print(f"report: {report}")
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
