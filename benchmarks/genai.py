#!/usr/bin/env python
"""Benchmark: decode speed of onnxruntime-genai against slmedge's onnxruntime runtime and llama.cpp,
on the same calibrated weights, in one run.

On SmolLM2-135M (the embedded default), GPTQ W4 g32 sym and AWQ W4 g32 asym artifacts:

- ``slmedge export --format onnxruntime-genai`` of each (the artifact's codes as MatMulNBits,
  accuracy level 4), run in onnxruntime-genai's own Generator loop (``runtime onnxruntime-genai``)
  and, the same ``model.onnx``, in slmedge's ``onnxruntime`` runtime (its own prefill + step loop
  over ``InferenceSession.run``);
- the GGUF export of the same codes (GPTQ -> Q4_0, AWQ -> Q4_1, exact) in llama.cpp.

Each runtime's ``timed_generate``: a prompt of ``--prompt`` tokens, ``--gen`` greedy tokens; TTFT,
prefill and decode tokens/s, median of ``--repeats`` runs after a warm-up, the three runtimes
taking turns run by run. Everything runs one after the other with the same thread count (never
two timed things at once). Perplexity of the
genai folder in both ONNX runtimes is printed too (the same file: they should agree).

    .venv/bin/python benchmarks/genai.py
    .venv/bin/python benchmarks/genai.py --threads 2 --gen 64 --repeats 5 --workdir .bench/genai
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

RECIPES = {"gptq": dict(method="gptq", bits=4, group_size=32, symmetric=True),
           "awq": dict(method="awq", bits=4, group_size=32, symmetric=False)}
GGUF_TYPE = {"gptq": "q4_0", "awq": "q4_1"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def timings(rts: dict, prompt: list[int], n_gen: int, repeats: int) -> dict:
    """Each runtime's timings, the runtimes taking turns run by run (a load that comes and goes on
    a shared machine then falls on all of them alike), after one warm-up each."""
    for rt in rts.values():
        rt.timed_generate(prompt, n_gen)
    runs: dict[str, list] = {label: [] for label in rts}
    for _ in range(repeats):
        for label, rt in rts.items():
            runs[label].append(rt.timed_generate(prompt, n_gen))
    out = {}
    for label, rs in runs.items():
        med = lambda key: statistics.median(getattr(r, key) for r in rs)  # noqa: E731
        out[label] = {"ttft_ms": 1000 * med("ttft_s"), "prefill_tps": med("prefill_tps"),
                      "decode_tps": med("decode_tps"), "decode_tps_runs": [round(r.decode_tps, 1) for r in rs]}
    return out


def perplexity(rt, windows) -> float:
    import numpy as np

    from slmedge.runtimes.base import _token_scores

    nll, n = 0.0, 0
    for ids in windows:
        lp, _ = _token_scores(rt.logits(ids[:-1]), ids[1:])
        nll -= float(lp.sum())
        n += len(ids) - 1
    return float(np.exp(nll / n))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "genai")
    ap.add_argument("--nsamples", type=int, default=32, help="calibration samples (x 512 tokens of C4)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--gen", type=int, default=64, help="generated tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--windows", type=int, default=2, help="512-token WikiText-2 windows for the perplexity check")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    wd = args.workdir
    wd.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    from slmedge.compress.api import compress
    from slmedge.compress.recipe import Recipe
    from slmedge.evaluate.corpora import load_corpus
    from slmedge.evaluate.perplexity import windows_of
    from slmedge.export.gguf import export_gguf
    from slmedge.export.ort_genai import export_genai
    from slmedge.runtimes.genai_runtime import GenaiRuntime
    from slmedge.runtimes.llamacpp_runtime import LlamaCppRuntime
    from slmedge.runtimes.onnx_runtime import OnnxRuntime

    results: dict = {"model": "SmolLM2-135M-Instruct (embedded)", "threads": args.threads,
                     "shape": f"prompt {args.prompt}, generate {args.gen}, median of {args.repeats}", "runs": {}}
    for name, kw in RECIPES.items():
        art = wd / f"art-{name}-g32"
        if not (art / "slmedge.json").is_file():
            log(f"compressing {name} (W4 g32, {args.nsamples} x 512 C4 tokens)")
            compress("smollm2-135m", Recipe(calibration="c4", nsamples=args.nsamples, seqlen=512, **kw), art,
                     overwrite=True)
        genai_dir, gguf = wd / f"{name}-genai-int4", wd / f"{name}-{GGUF_TYPE[name]}.gguf"
        if not (genai_dir / "genai_config.json").is_file():
            log(f"exporting {name} to onnxruntime-genai (int4, codes kept)")
            export_genai(art, genai_dir, "int4", exact=True, overwrite=True, n_threads=args.threads)
        if not gguf.is_file():
            log(f"exporting {name} to GGUF {GGUF_TYPE[name]} (codes kept)")
            export_gguf(art, gguf, GGUF_TYPE[name], exact=True, overwrite=True)
        tok = AutoTokenizer.from_pretrained(str(genai_dir))
        text = load_corpus("wikitext2")
        ids = tok(text[:20000])["input_ids"]
        prompt = ids[: args.prompt]
        windows = [w.tolist() for w in windows_of(tok, text, 512, args.windows)[0]]
        rts = {"onnxruntime-genai": GenaiRuntime(genai_dir, args.threads, n_ctx=2048),
               "onnxruntime (slmedge)": OnnxRuntime(genai_dir / "model.onnx", args.threads),
               f"llama.cpp {GGUF_TYPE[name]}": LlamaCppRuntime(gguf, args.threads, n_ctx=2048)}
        try:
            log(f"{name}: timing {', '.join(rts)} (taking turns)")
            row = timings(rts, prompt, args.gen, args.repeats)
            for label, rt in rts.items():
                if label.startswith("onnxruntime"):  # the same model.onnx: the same perplexity
                    row[label]["perplexity"] = perplexity(rt, windows)
        finally:
            for rt in rts.values():
                rt.close()
        results["runs"][name] = row

    print(f"\n{results['model']}, {results['threads']} threads, {results['shape']}")
    print(f"{'artifact':8} {'runtime':24} {'decode tok/s':>12} {'prefill tok/s':>13} {'TTFT ms':>8} {'PPL':>9}")
    for name, row in results["runs"].items():
        for label, r in row.items():
            ppl = f"{r['perplexity']:.4f}" if "perplexity" in r else "-"
            print(f"{name:8} {label:24} {r['decode_tps']:12.1f} {r['prefill_tps']:13.1f} {r['ttft_ms']:8.1f} {ppl:>9}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
