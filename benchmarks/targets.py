#!/usr/bin/env python
"""Benchmark: decode speed against the roofline, and an emulated arm64 run with its parity figures.

On SmolLM2-135M exported to GGUF f16 and q4_0 (the embedded default):

1. ``cpu`` (this machine): slmedge's measured decode tokens/s (pp/tg split, median of repeats)
   against this machine's roofline (bandwidth measured by ``slmedge targets show cpu``),
   side by side with llama.cpp's own numbers for the same file: llama-cpp-python's generation
   loop (``Llama.generate``), timed by llama.cpp's perf counters.
2. ``arm64`` (emulated): the q4_0 file's perplexity on one WikiText-2 window and a few decode
   steps under qemu; parity against native x86 (perplexity, max |delta log-prob| per token);
   the timing shown as emulated, never as device latency.

    .venv/bin/python benchmarks/targets.py            # run it with nothing else on the machine
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def llama_cpp_own(path: Path, prompt: list[int], n_gen: int, threads: int, repeats: int) -> dict:
    """llama-cpp-python's generation loop on the file, timed by llama.cpp's own counters."""
    import llama_cpp

    from slmedge.backends.llamacpp import load_llama, quiet_native_stderr

    with quiet_native_stderr():  # the same kernels as slmedge's runtime (load_llama: AMX builds)
        llm = load_llama(path, n_ctx=len(prompt) + n_gen + 8, n_batch=512, verbose=False,
                         n_threads=threads, n_threads_batch=threads)
    decode, prefill, wall = [], [], []
    for i in range(repeats + 1):
        llm.reset()
        llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
        stamps = []
        for j, _ in enumerate(llm.generate(prompt, temp=0.0, reset=True)):
            stamps.append(time.perf_counter())
            if j + 1 >= n_gen:
                break
        perf = llama_cpp.llama_perf_context(llm._ctx.ctx)
        if i:  # the first run warms up
            decode.append(perf.n_eval / (perf.t_eval_ms / 1000))
            prefill.append(perf.n_p_eval / (perf.t_p_eval_ms / 1000))
            wall.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))  # the loop as a user sees it
    llm.close()
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    return {"decode_tps": med(decode), "prefill_tps": med(prefill), "decode_wall_tps": med(wall)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "targets")
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--tg", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--arm64-tokens", type=int, default=64, help="window of the emulated perplexity check")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)

    from slmedge.evaluate.api import EvalSettings, evaluate
    from slmedge.evaluate.corpora import load_corpus
    from slmedge.export.api import source_folder
    from slmedge.export.gguf import export_gguf
    from slmedge.targets.profiles import get_profile

    hf = source_folder("smollm2-135m")
    files = {}
    for qtype in ("f16", "q4_0"):
        files[qtype] = args.workdir / f"smollm2-{qtype}.gguf"
        if not files[qtype].is_file():
            log(f"exporting {qtype}")
            export_gguf(hf, files[qtype], qtype)
    cpu = get_profile("cpu")
    out = {"cpu_profile": {"bandwidth_gbs": cpu.memory_bandwidth_gbs, "fp32_gflops": cpu.peak_fp32_gflops,
                           "measured": cpu.measured}, "rows": {}}
    text = load_corpus("wikitext2")

    # --- 1. cpu: ours vs llama.cpp's own loop, against the roofline -------------------------------
    for qtype, path in files.items():
        log(f"cpu {qtype}: slmedge latency")
        res = evaluate(str(path), EvalSettings(metrics=("latency",), langs=(), pp=args.pp, tg=args.tg,
                                               repeats=args.repeats, threads=args.threads))
        lat = res["metrics"]["latency"]
        from slmedge.evaluate.subject import open_subject

        sub = open_subject(str(path), threads=args.threads)
        prompt = sub.encoder.encode(text[:20000])[: args.pp]
        sub.close()
        log(f"cpu {qtype}: llama-cpp-python's generate loop")
        own = llama_cpp_own(path, prompt, args.tg, args.threads, args.repeats)
        roof = lat["roofline"]
        out["rows"][qtype] = {"size_mb": path.stat().st_size / 1e6, "ours_decode_tps": lat["decode_tps"]["median"],
                              "ours_prefill_tps": lat["prefill_tps"]["median"], "llama_cpp_decode_tps": own["decode_tps"],
                              "llama_cpp_prefill_tps": own["prefill_tps"], "llama_cpp_decode_wall_tps": own["decode_wall_tps"],
                              "decode_bound_tps": roof["decode_bound_tps"],
                              "prefill_bound_tps": roof.get("prefill_bound_tps")}

    # --- 2. arm64, emulated: parity on the q4_0 file ---------------------------------------------
    from slmedge.targets.emulation import up_to_date

    if up_to_date():
        corpus = args.workdir / "window.txt"
        corpus.write_text(text[:4000], encoding="utf-8")
        s = dict(metrics=("perplexity", "latency"), langs=(), wikitext=False, corpora=(str(corpus),),
                 seqlen=args.arm64_tokens, ppl_windows=1, pp=16, tg=4, repeats=1, threads=min(2, args.threads))
        log("q4_0 native (parity reference)")
        native = evaluate(str(files["q4_0"]), EvalSettings(**s))
        log("q4_0 on arm64 under qemu")
        t = time.perf_counter()
        arm = evaluate(str(files["q4_0"]), EvalSettings(**s, target="arm64"))
        wall = time.perf_counter() - t
        # Per-token parity: the same window's log-probs on both sides.
        from slmedge.evaluate.subject import open_subject
        from slmedge.targets.profiles import get_profile as gp
        from slmedge.evaluate.subject import open_on_target

        nat = open_subject(str(files["q4_0"]), threads=2)
        emu = open_on_target(str(files["q4_0"]), None, 2, 256, gp("arm64"))
        ids = nat.encoder.encode(text[:4000])[: args.arm64_tokens]
        import numpy as np

        from slmedge.evaluate.perplexity import log_softmax_np

        la, lb = log_softmax_np(nat.runtime.logits(ids)), log_softmax_np(emu.runtime.logits(ids))
        nat.close()
        emu.close()
        kl = (np.exp(la) * (la - lb)).sum(-1)
        tgt = np.arange(len(ids) - 1), np.asarray(ids[1:])
        dlp = np.abs(la[:-1][tgt] - lb[:-1][tgt])
        out["arm64"] = {"native_ppl": native["metrics"]["perplexity"]["window.txt"]["perplexity"],
                        "emulated_ppl": arm["metrics"]["perplexity"]["window.txt"]["perplexity"],
                        "max_abs_dlogprob": float(dlp.max()), "mean_abs_dlogprob": float(dlp.mean()),
                        "kl_mean": float(kl.mean()), "top1_agreement": float((la.argmax(-1) == lb.argmax(-1)).mean()),
                        "tokens": len(ids) - 1,
                        "emulated_decode_tps": arm["metrics"]["latency"]["decode_tps"]["median"],
                        "native_decode_tps": native["metrics"]["latency"]["decode_tps"]["median"],
                        "wall_s": wall, "versions": arm["versions"].get("target")}
    else:
        print("arm64 is not set up (slmedge targets setup arm64): skipping part 2")

    # --- print -----------------------------------------------------------------------------------
    print(f"\nSmolLM2-135M GGUF, {args.threads} threads, pp{args.pp}/tg{args.tg}, median of {args.repeats}; "
          f"this machine: {cpu.memory_bandwidth_gbs:.1f} GB/s, {cpu.peak_fp32_gflops:.0f} GFLOP/s fp32 (measured)\n")
    print("   tg/pp: tokens/s. llama.cpp: its generation loop timed by llama.cpp's perf counters (decode "
          "compute only) and by the wall clock between tokens (what its Python loop delivers).")
    print(f"   {'file':6} {'MB':>6} {'tg bound':>9} {'slmedge tg':>11} {'of bound':>9} {'llama.cpp tg':>13} "
          f"{'of bound':>9} {'tg wall':>8} {'ours/wall':>10} {'slmedge pp':>11} {'llama.cpp pp':>13}")
    for q, r in out["rows"].items():
        b = r["decode_bound_tps"]
        print(f"   {q:6} {r['size_mb']:6.1f} {b:9.1f} {r['ours_decode_tps']:11.1f} {r['ours_decode_tps'] / b:9.0%} "
              f"{r['llama_cpp_decode_tps']:13.1f} {r['llama_cpp_decode_tps'] / b:9.0%} "
              f"{r['llama_cpp_decode_wall_tps']:8.1f} {r['ours_decode_tps'] / r['llama_cpp_decode_wall_tps']:10.2f} "
              f"{r['ours_prefill_tps']:11.1f} {r['llama_cpp_prefill_tps']:13.1f}")
    if "arm64" in out:
        a = out["arm64"]
        print(f"\n   arm64 (qemu, {a['versions'].get('machine')}, emulated) q4_0, {a['tokens']} tokens: perplexity "
              f"{a['emulated_ppl']:.4f} vs native {a['native_ppl']:.4f}; KL {a['kl_mean']:.2e}, top-1 "
              f"{a['top1_agreement']:.1%}, |d log-prob| mean {a['mean_abs_dlogprob']:.2e} max {a['max_abs_dlogprob']:.2e}; "
              f"decode {a['emulated_decode_tps']:.2f} tok/s EMULATED (native {a['native_decode_tps']:.1f}); "
              f"wall {a['wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
