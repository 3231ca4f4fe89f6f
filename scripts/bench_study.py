#!/usr/bin/env python
"""Benchmark: a study end to end on SmolLM2-135M — wall time, jobs per minute, what sharing
artifacts saved against running every evaluation's chain alone — and the seed study's findings
checked one by one on whatever the store holds.

    .venv/bin/python scripts/bench_study.py                          # the quick study (~30 min, 2 cores)
    .venv/bin/python scripts/bench_study.py --study scripts/studies/seed.toml   # the seed grid (hours; resumable)

Findings checked (the seed study's claims): quantization ahead of pruning on fidelity (mean KL,
top-1), on multilingual perplexity (mean over languages) and on task accuracy (mean over tasks);
and whether Wanda beats SparseGPT. Each is printed with the numbers, as holds / does not hold.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def mean(values):
    v = [x for x in values if x is not None]
    return sum(v) / len(v) if v else None


def findings(rows: list[dict]) -> list[str]:
    """The seed study's claims against these rows (torch artifacts and exports alike)."""
    def kind(r):
        name = r["labels"].get("method_name")
        return {"gptq": "quant", "awq": "quant", "rtn": "quant", "sparsegpt": "prune", "wanda": "prune",
                "magnitude": "prune"}.get(name)

    def agg(group, metric, how=mean):
        vals = [how(list(r["metrics"].get(metric, {}).values())) for r in group]
        return mean(vals)

    out = []
    quant = [r for r in rows if kind(r) == "quant"]
    prune = [r for r in rows if kind(r) == "prune"]
    if quant and prune:
        for metric, label, lower_better in (("kl_mean", "fidelity (mean KL)", True),
                                            ("top1_agreement", "fidelity (top-1 agreement)", False),
                                            ("perplexity", "multilingual perplexity (mean over corpora)", True),
                                            ("acc", "task accuracy (mean acc over tasks)", False)):
            q, p = agg(quant, metric), agg(prune, metric)
            if q is None or p is None:
                continue
            holds = q < p if lower_better else q > p
            out.append(f"quantization ahead of pruning on {label}: quantized {q:.4g} vs pruned {p:.4g} -> "
                       f"{'holds' if holds else 'does NOT hold'}")
    wanda = [r for r in rows if r["labels"].get("method_name") == "wanda"]
    sgpt = [r for r in rows if r["labels"].get("method_name") == "sparsegpt"]
    if wanda and sgpt:
        w, s = agg(wanda, "perplexity"), agg(sgpt, "perplexity")
        out.append(f"Wanda vs SparseGPT (mean perplexity): Wanda {w:.4g}, SparseGPT {s:.4g} -> "
                   f"{'Wanda better' if w < s else 'SparseGPT better'}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", type=Path, default=ROOT / "scripts" / "studies" / "quick.toml")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "study")
    ap.add_argument("--fresh", action="store_true", help="Start from nothing (else resume).")
    ap.add_argument("--engine", default="local")
    args = ap.parse_args()
    import shutil

    from slmedge.evaluate.store import ResultsStore
    from slmedge.study.engine import run_study
    from slmedge.study.report import load_rows, write_report
    from slmedge.study.spec import load_study

    study = load_study(args.study)
    wd = args.workdir / study.name
    if args.fresh:
        shutil.rmtree(wd, ignore_errors=True)
    wd.mkdir(parents=True, exist_ok=True)
    store = ResultsStore(wd / "results.sqlite")
    t = time.perf_counter()
    counts = run_study(study, store, engine=args.engine, workdir=wd / "work",
                       progress=lambda j, c, left: print(f"[{time.strftime('%H:%M:%S')}] {j.kind} {j.id} done, "
                                                         f"{left} left", file=sys.stderr, flush=True))
    wall = time.perf_counter() - t
    jobs = store.db.execute("SELECT job_id, kind, deps, seconds FROM study_jobs WHERE study = ?", (study.name,)).fetchall()
    secs = {j: s or 0.0 for j, _, _, s in jobs}
    deps = {j: json.loads(d) for j, _, d, _ in jobs}

    def chain(j):  # the job and everything it needs, as if run alone
        return secs[j] + sum(chain(d) for d in deps[j])

    shared = sum(secs.values())
    alone = sum(chain(j) for j, k, _, _ in jobs if k == "evaluate")
    report = wd / f"{study.name}.html"
    write_report(store, report, "html", study.name)
    rows = load_rows(store, study.name)
    print(f"\nstudy {study.name}: {counts['jobs']} jobs ({counts['ran']} run now, {counts['already_done']} done before); "
          f"wall {wall:.0f} s, {counts['ran'] / max(wall / 60, 1e-9):.2f} jobs/min")
    print(f"job time with sharing {shared:.0f} s; every evaluation's chain alone {alone:.0f} s; "
          f"sharing saved {alone - shared:.0f} s ({1 - shared / alone:.0%})" if alone else "")
    for line in findings(rows):
        print("  " + line)
    print(f"report: {report}")
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
