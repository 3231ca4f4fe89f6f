#!/usr/bin/env python
"""Benchmark: which calibration text makes compressed models that hold up in every language.

For each model, method and calibration spec (``--calibrations``; default C4 alone, the shipped
multilingual text, and a mix of the two): ``slmedge compress`` with that calibration, then
``slmedge evaluate`` of the artifact in torch: perplexity on each of the 14 NTREX-128 languages and
WikiText-2, mean KL and top-1 against the base model on WikiText-2. The base model and RTN (which
reads no calibration) are scored the same way, for reference.

Printed (markdown, and every number in ``WORK/MODEL/results.json``), per model: perplexity per
language, then geometric means over the 14 languages, over the six that no calibration text holds
(it ja pt sw th tr: what generalises rather than what was seen), and English. The default
calibration should win on the languages, not only on English.

Runs one step after another. Resumable: an artifact or score already in WORK is reused while its
inputs (model, options, calibration, sizes, slmedge's source) are unchanged.

    .venv/bin/python benchmarks/calibration.py
    .venv/bin/python benchmarks/calibration.py --models smollm2-135m --methods gptq-iq4_xs --nsamples 64
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gguf_peers import METHODS, fresh, log, run, slmedge, stamp  # noqa: E402

CALIBRATIONS = ("c4", "multilingual", "c4+multilingual")
DEFAULT_METHODS = ("gptq-iq4_xs", "awq-iq4_xs", "gptq-q4_k")


def source_digest() -> str:
    """slmedge's own source (a changed method or sampler makes new artifacts)."""
    h = hashlib.sha256()
    for f in sorted((ROOT / "slmedge").rglob("*.py")):
        h.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def score(target: str, model: str, out: Path, inputs: dict, args, langs: list[str]) -> dict:
    if fresh(out, inputs):
        return json.loads(out.read_text())
    from slmedge.evaluate.api import EvalSettings, evaluate

    log(f"score {target}")
    started = time.perf_counter()
    metrics = ("perplexity",) if target == model else ("fidelity", "perplexity")
    res = evaluate(target, EvalSettings(metrics=metrics, langs=tuple(langs), wikitext=True, reference=model,
                                        ppl_windows=args.ppl_windows, fidelity_windows=args.fidelity_windows,
                                        seqlen=args.seqlen, threads=args.threads),
                   json_path=out.with_name(out.name.replace(".score.json", ".eval.json")))
    log(f"score {target}: {time.perf_counter() - started:.1f} s")
    m = res["metrics"]
    fid = m.get("fidelity") or {}
    ppl = {k: v["perplexity"] for k, v in (m.get("perplexity") or {}).items() if isinstance(v, dict) and "perplexity" in v}
    row = {"mean_kl": fid.get("kl_mean"), "top1": fid.get("top1_agreement"), "ppl": ppl}
    out.write_text(json.dumps(row, indent=2))
    stamp(out, inputs)
    return row


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summarize(row: dict, langs: list[str], unseen: list[str]) -> dict:
    ppl = row["ppl"]
    return {"all": geomean([ppl[k] for k in langs if k in ppl]), "unseen": geomean([ppl[k] for k in unseen if k in ppl]),
            "en": ppl.get("en"), "wikitext2": next((v for k, v in ppl.items() if k.startswith("wikitext")), None)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), help=f"{', '.join(METHODS)}")
    ap.add_argument("--calibrations", nargs="+", default=list(CALIBRATIONS))
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--ppl-windows", type=int, default=2, help="windows of --seqlen tokens per language")
    ap.add_argument("--fidelity-windows", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--work", type=Path, default=ROOT / ".bench" / "calibration")
    ap.add_argument("--keep", action="store_true", help="keep the artifacts (default: deleted once scored)")
    args = ap.parse_args()
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"error: --methods: unknown {unknown[0]}; choose from {', '.join(METHODS)}")
    from slmedge.data.calibration import calibration_sources, spec_parts
    from slmedge.evaluate.corpora import ntrex_languages

    from slmedge.errors import DataError

    for spec in args.calibrations:
        try:
            calibration_sources(spec)  # an unknown name or a missing file: its message, before any work
        except DataError as exc:
            raise SystemExit(f"error: --calibrations: {exc}") from None
    langs = ntrex_languages()
    seen = set()
    for spec in args.calibrations:
        for part in spec_parts(spec):
            kind, where = calibration_sources(part)
            seen |= {Path(rel).stem for rel in where} if kind == "data" and part.startswith("multilingual") else set()
            seen |= {"en"} if part == "c4" else set()
    unseen = [lang for lang in langs if lang not in seen]
    code = source_digest()
    for model in args.models:
        work = args.work / model
        work.mkdir(parents=True, exist_ok=True)
        sizes = {"ppl_windows": args.ppl_windows, "fidelity_windows": args.fidelity_windows, "seqlen": args.seqlen,
                 "langs": langs, "code": code}
        rows = {"base": score(model, model, work / "base.score.json", {"model": model, **sizes}, args, langs)}
        plan = [(label, spec) for label in args.methods for spec in args.calibrations]
        plan += sorted({(label.replace(label.split("-")[0], "rtn", 1), None) for label in args.methods
                        if label.replace(label.split("-")[0], "rtn", 1) in METHODS})
        for label, spec in plan:
            opts = METHODS[label][0]
            name = f"{label}.{spec.replace('+', '_').replace(':', '-').replace('/', '_')}" if spec else label
            art = work / f"artifact-{name}"
            inputs = {"model": model, "opts": opts, "calibration": spec, "nsamples": args.nsamples,
                      "seqlen": args.seqlen, **sizes}
            out = work / f"{name}.score.json"
            if not fresh(out, inputs):
                run(slmedge("compress", model, *opts, *(["--calibration", spec] if spec else []), "--nsamples",
                            args.nsamples, "--seqlen", args.seqlen, "-o", art, "--overwrite"), f"compress {name}",
                    work / f"compress-{name}.log")
            rows[f"{label} {spec}" if spec else label] = score(str(art), model, out, inputs, args, langs)
            if not args.keep:
                shutil.rmtree(art, ignore_errors=True)
        (work / "results.json").write_text(json.dumps({"model": model, "langs": langs, "unseen": unseen,
                                                       "args": {k: str(v) for k, v in vars(args).items()},
                                                       "rows": rows}, indent=2))
        print_table(model, rows, langs, unseen)
    return 0


def print_table(model: str, rows: dict, langs: list[str], unseen: list[str]) -> None:
    print(f"\n### {model}: perplexity per language (NTREX-128), {len(langs)} languages\n")
    print("| row | " + " | ".join(langs) + " | WikiText-2 |")
    print("|---|" + "---:|" * (len(langs) + 1))
    for label, r in rows.items():
        s = summarize(r, langs, unseen)
        print(f"| {label} | " + " | ".join(f"{r['ppl'][k]:.2f}" if k in r["ppl"] else "-" for k in langs)
              + f" | {s['wikitext2']:.2f} |")
    print(f"\n### {model}: summary (geometric means; unseen = {' '.join(unseen)}: in no calibration text)\n")
    print("| row | mean KL | top-1 | ppl, all languages | ppl, unseen | ppl, en | ppl, WikiText-2 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, r in rows.items():
        s = summarize(r, langs, unseen)
        kl = f"{r['mean_kl']:.4f}" if r.get("mean_kl") is not None else "-"
        top1 = f"{r['top1']:.1%}" if r.get("top1") is not None else "-"
        print(f"| {label} | {kl} | {top1} | {s['all']:.2f} | {s['unseen']:.2f} | {s['en']:.2f} | {s['wikitext2']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
