#!/usr/bin/env python
"""Benchmark: slmedge's compression methods against llm-compressor, side by side, in one run.

On SmolLM2-135M (the embedded default), with the same 32 x 512 C4 calibration tokens and the
same WikiText-2 windows (4 x 2048) for both: per method, our time, their time, the ratio, our
perplexity and theirs. llm-compressor runs in its own virtualenv (it needs transformers 5.x),
created by benchmarks/llmc_env.sh; it gets our token ids, never re-tokenizes. Times are the
compression call alone (their ``oneshot``, our calibration + compression + writing the artifact
block by block as ``slmedge compress`` does; ``--in-memory``: the whole model kept in fp32 and
nothing written, what the tables of docs/development/notebook.md before 2026-12-02 timed), run one
after the other, never at the same time: on 2 cores anything running beside a timed run distorts it.
The 1-minute load average (``uptime``) is recorded before and after each timed call (columns
``load``: ours before/after, theirs before/after): a load above the core count means something
else shared the cores, and both sides' times are then inflated (ratios within one run still
compare like with like only when the loads are alike).

    .venv/bin/python benchmarks/compress_peers.py                 # default methods
    .venv/bin/python benchmarks/compress_peers.py --methods gptq,wanda --no-peer
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slmedge.compress.api import compress  # noqa: E402
from slmedge.compress.recipe import Recipe  # noqa: E402
from slmedge.data.calibration import load_calibration  # noqa: E402
from slmedge.evaluate.corpora import load_corpus  # noqa: E402
from slmedge.evaluate.perplexity import token_nll, windows_of  # noqa: E402
from slmedge.models.source import load  # noqa: E402

# name -> (our recipe fields, llm-compressor recipe)
CONFIGS = {
    "rtn": (dict(method="rtn", bits=4, group_size=64), {"method": "rtn", "bits": 4, "group_size": 64, "symmetric": False}),
    "gptq": (dict(method="gptq", bits=4, group_size=64, symmetric=True),
             {"method": "gptq", "bits": 4, "group_size": 64, "symmetric": True}),
    "gptq-asym": (dict(method="gptq", bits=4, group_size=64),
                  {"method": "gptq", "bits": 4, "group_size": 64, "symmetric": False}),
    "awq": (dict(method="awq", bits=4, group_size=64), {"method": "awq", "bits": 4, "group_size": 64, "symmetric": False}),
    "magnitude": (dict(method="magnitude", bits=None, sparsity="0.5"), {"method": "magnitude", "sparsity": 0.5}),
    "wanda": (dict(method="wanda", bits=None, sparsity="0.5"), {"method": "wanda", "sparsity": 0.5}),
    "wanda-2:4": (dict(method="wanda", bits=None, sparsity="2:4"), {"method": "wanda", "sparsity": "2:4"}),
    "sparsegpt": (dict(method="sparsegpt", bits=None, sparsity="0.5"), {"method": "sparsegpt", "sparsity": 0.5}),
    "sparsegpt-2:4": (dict(method="sparsegpt", bits=None, sparsity="2:4"), {"method": "sparsegpt", "sparsity": "2:4"}),
}
DEFAULT = "rtn,gptq,awq,magnitude,wanda,sparsegpt"


def peer_python() -> Path:
    """The Python of llm-compressor's virtualenv, created (idempotently) by benchmarks/llmc_env.sh."""
    subprocess.run(["bash", str(ROOT / "benchmarks" / "llmc_env.sh")], check=True)
    return ROOT / os.environ.get("LLMC_VENV", ".bench/llmc-venv") / "bin" / "python"


def eval_ppl(model, windows: torch.Tensor) -> float:
    nll = torch.cat([token_nll(model, w) for w in windows]).double()
    return math.exp(float(nll.mean()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=DEFAULT, help=f"comma-separated, from: {', '.join(CONFIGS)}")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=4)
    ap.add_argument("--eval-seqlen", type=int, default=2048)
    ap.add_argument("--no-peer", action="store_true", help="only our side")
    ap.add_argument("--in-memory", action="store_true",
                    help="time compress(write=False), the whole model kept in fp32, instead of what `slmedge compress` "
                         "does (load in the source dtype, compress and write the artifact block by block)")
    ap.add_argument("--out", default=str(ROOT / ".bench" / "compress_results.json"))
    args = ap.parse_args()
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in CONFIGS]
    if unknown:
        ap.error(f"unknown methods: {unknown}")

    peer_py = None if args.no_peer else peer_python()

    base = load(None)
    tok = base.tokenizer
    calib = load_calibration("c4", tok, args.nsamples, args.seqlen, seed=0).tokens
    windows, _ = windows_of(tok, load_corpus("wikitext2"), args.eval_seqlen, args.eval_windows)
    work = Path(tempfile.mkdtemp(prefix="slmedge-bench-"))
    save_file({"input_ids": calib.contiguous()}, str(work / "calib.safetensors"))
    save_file({"input_ids": windows.contiguous()}, str(work / "eval.safetensors"))
    base_ppl = eval_ppl(base.model, windows)
    del base
    print(f"SmolLM2-135M base: WikiText-2 perplexity {base_ppl:.2f} ({args.eval_windows} x {args.eval_seqlen} tokens); "
          f"calibration C4 {args.nsamples} x {args.seqlen}; torch threads {torch.get_num_threads()}", flush=True)

    rows = []
    for name in names:
        ours_kw, theirs = CONFIGS[name]
        recipe = Recipe(nsamples=args.nsamples, seqlen=args.seqlen, **ours_kw)
        # Same model, tokens and windows: calibration tokens come from the same spec and seed.
        load_before = os.getloadavg()[0]
        if args.in_memory:
            outcome = compress(None, recipe, write=False, device="cpu")
        else:  # the artifact written block by block, as `slmedge compress` does; perplexity from the artifact
            outcome = compress(None, recipe, work / f"{name}-artifact", device="cpu")
        load_after = os.getloadavg()[0]
        ours_s = outcome.result.timings["compress_s"]
        ours_ppl = eval_ppl(outcome.model(), windows)
        row = {"method": name, "ours_s": ours_s, "ours_ppl": ours_ppl, "ours_load": [load_before, load_after],
               "ours_timings": dict(outcome.result.timings)}
        if outcome.artifact is not None:
            shutil.rmtree(outcome.artifact)  # our own temporary folder
        del outcome
        if peer_py is not None:
            out = work / f"{name}.json"
            load_before = os.getloadavg()[0]
            subprocess.run([str(peer_py), str(ROOT / "benchmarks" / "llmc_worker.py"), "--model",
                            str(load(None).hf_dir), "--calib", str(work / "calib.safetensors"), "--eval",
                            str(work / "eval.safetensors"), "--recipe", json.dumps(theirs), "--out", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            row["theirs_load"] = [load_before, os.getloadavg()[0]]
            peer = json.loads(out.read_text()) if out.is_file() else {"status": "error", "error": "no result"}
            row.update(theirs_status=peer.get("status"), theirs_s=peer.get("seconds"), theirs_ppl=peer.get("perplexity"),
                       theirs_error=peer.get("error"), theirs_versions=peer.get("versions"))
        rows.append(row)
        print(_line(row), flush=True)

    print()
    print(f"{'method':<14} {'ours s':>8} {'theirs s':>9} {'ratio':>6} {'ours ppl':>9} {'theirs ppl':>10} {'load (ours; theirs)':>22}"
          f"   base {base_ppl:.2f}")
    for row in rows:
        print(_line(row))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"base_ppl": base_ppl, "rows": rows, "args": vars(args),
                                          "time": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    print(f"\nresults: {args.out}")
    return 0


def _line(row: dict) -> str:
    theirs_s, theirs_ppl = row.get("theirs_s"), row.get("theirs_ppl")
    status = row.get("theirs_status")
    if status not in (None, "ok"):
        tail = f"{'—':>9} {'—':>6} {row['ours_ppl']:>9.2f} {status:>10}"
    elif theirs_s is None:
        tail = f"{'—':>9} {'—':>6} {row['ours_ppl']:>9.2f} {'—':>10}"
    else:
        tail = f"{theirs_s:>9.1f} {row['ours_s'] / theirs_s:>6.2f} {row['ours_ppl']:>9.2f} {theirs_ppl:>10.2f}"
    loads = "; ".join("{:.1f}→{:.1f}".format(*pair) for pair in (row["ours_load"], row.get("theirs_load")) if pair)
    return f"{row['method']:<14} {row['ours_s']:>8.1f} {tail} {loads:>22}"


if __name__ == "__main__":
    sys.exit(main())
