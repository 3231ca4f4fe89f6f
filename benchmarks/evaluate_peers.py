#!/usr/bin/env python
"""Benchmark: evaluation throughput per runtime, and slmedge's task scoring against
lm-evaluation-harness's ``hf`` model on the same local task files, side by side in one run.

On SmolLM2-135M (the embedded default):

1. Perplexity scoring throughput (tokens/s over WikiText-2 windows) and task throughput
   (items/s) in torch, onnxruntime (fp32 export) and llama.cpp (f32 GGUF).
2. The same task files scored by lm-evaluation-harness (``--model hf``, batch size 1, fp32, CPU,
   tasks defined by YAML over our JSONL files) and by slmedge in torch: accuracy (must be
   identical) and wall time (goal: ours <= half of theirs). Also lm-eval through our model class
   (``--model slmedge``), to show the integration gives the same numbers.

Needs ``pip install lm_eval`` (the ``bench`` extra). Runs one thing at a time (2 cores).

    .venv/bin/python benchmarks/evaluate_peers.py
    .venv/bin/python benchmarks/evaluate_peers.py --tasks arc_easy,piqa --limit 100
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "evaluate")
    ap.add_argument("--tasks", default="arc_easy,piqa,winogrande,hellaswag")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    wd = args.workdir
    wd.mkdir(parents=True, exist_ok=True)
    tasks = [t for t in args.tasks.split(",") if t]

    import torch

    torch.set_num_threads(args.threads)
    from slmedge.evaluate.corpora import load_corpus
    from slmedge.evaluate.perplexity import runtime_perplexity
    from slmedge.evaluate.subject import open_subject
    from slmedge.evaluate.tasks import run_task
    from slmedge.export.api import source_folder
    from slmedge.export.gguf import export_gguf
    from slmedge.export.onnx import export_onnx

    hf_dir = source_folder("smollm2-135m")
    gguf_path = wd / "smollm2-f32.gguf"
    if not gguf_path.is_file():
        export_gguf(hf_dir, gguf_path, "f32")
    onnx_dir = wd / "smollm2-onnx-fp32"
    if not (onnx_dir / "slmedge-export.json").is_file():
        export_onnx(hf_dir, onnx_dir, "fp32", overwrite=True)
    text = load_corpus("wikitext2")
    results: dict = {"tasks": tasks, "limit": args.limit, "threads": args.threads}

    # --- 1. throughput per runtime -----------------------------------------------------------------
    through = {}
    ours_tasks = {}
    for spec in (str(hf_dir), str(onnx_dir), str(gguf_path)):
        sub = open_subject(spec, threads=args.threads, n_ctx=max(2048, args.seqlen))
        rt = sub.runtime.name
        log(f"{rt}: perplexity")
        t = time.perf_counter()
        ppl, _ = runtime_perplexity(sub.runtime, sub.encoder, text, args.seqlen, None, args.windows)
        ppl_s = time.perf_counter() - t
        row = {"ppl": ppl.perplexity, "ppl_tokens_per_s": ppl.tokens / ppl_s}
        t = time.perf_counter()
        accs, items = {}, 0
        for name in tasks:
            log(f"{rt}: {name}")
            summary, _ = run_task(sub.runtime, sub.encoder, name, limit=args.limit)
            accs[name] = summary
            items += summary["n"]
        task_s = time.perf_counter() - t
        row.update(items_per_s=items / task_s, task_s=task_s)
        through[rt] = row
        ours_tasks[rt] = accs
        sub.close()
    results["throughput"] = through

    # --- 1b. llama.cpp task scoring: the context with its outputs off (ours) against on ------------
    # Before this, the context of every item was decoded with llama.cpp's outputs on: the vocabulary
    # head for each context token, none of it read. Same file, same items, scored both ways in turn.
    q4_path = wd / "smollm2-q4_0.gguf"
    if not q4_path.is_file():
        export_gguf(hf_dir, q4_path, "q4_0")
    ctx_rows = {}
    for path in (gguf_path, q4_path):
        sub = open_subject(str(path), threads=args.threads, n_ctx=2048)
        llm = sub.runtime.llm
        real = llm._batch.set_batch

        def all_outputs(batch, n_past, logits_all, real=real):
            return real(batch=batch, n_past=n_past, logits_all=True)

        row = {}
        for mode in ("outputs on", "outputs off"):
            llm._batch.set_batch = all_outputs if mode == "outputs on" else real
            t = time.perf_counter()
            lls = []
            for name in tasks:
                log(f"llama.cpp {path.name}, context {mode}: {name}")
                _, scores = run_task(sub.runtime, sub.encoder, name, limit=args.limit)
                lls += [ll for s in scores for ll in s.loglikelihoods]
            row[mode] = {"task_s": time.perf_counter() - t, "lls": lls}
        llm._batch.set_batch = real
        sub.close()
        ctx_rows[path.name] = {"on_s": row["outputs on"]["task_s"], "off_s": row["outputs off"]["task_s"],
                               "identical": row["outputs on"]["lls"] == row["outputs off"]["lls"],
                               "n_loglikelihoods": len(row["outputs off"]["lls"])}
    results["llamacpp_context_outputs"] = ctx_rows

    # --- 2. lm-evaluation-harness hf, same files ---------------------------------------------------
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        print("lm_eval is not installed: pip install lm_eval (or pip install -e .[bench]); skipping part 2")
        lm_eval = None
    peer = {}
    if lm_eval is not None:
        ydir = wd / "lm_eval_tasks"
        shutil.rmtree(ydir, ignore_errors=True)
        from slmedge.evaluate.tasks import write_lm_eval_tasks

        write_lm_eval_tasks(ydir, tasks)
        tm = TaskManager(include_path=str(ydir))
        for model, model_args in (("hf", f"pretrained={hf_dir},dtype=float32,device=cpu"),
                                  ("slmedge", f"model={hf_dir},threads={args.threads}")):
            if model == "slmedge":
                import slmedge.lm_eval_model  # noqa: F401 - registers --model slmedge
            log(f"lm-eval --model {model}")
            t = time.perf_counter()
            out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[f"slmedge_{n}" for n in tasks],
                                          limit=args.limit, batch_size=1, task_manager=tm, log_samples=False)
            peer[model] = {"seconds": time.perf_counter() - t,
                           "results": {k.removeprefix("slmedge_"): {m.split(",")[0]: v for m, v in r.items()
                                                                     if m.startswith(("acc,", "acc_norm,"))}
                                       for k, r in out["results"].items()}}
    results["lm_eval"] = peer

    # --- print -------------------------------------------------------------------------------------
    print(f"\nSmolLM2-135M, {args.threads} threads; perplexity {args.windows} x {args.seqlen} WikiText-2; "
          f"tasks {', '.join(tasks)} (limit {args.limit})\n")
    print(f"   {'runtime':12} {'ppl':>8} {'ppl tok/s':>10} {'task items/s':>13} {'task s':>8}")
    for rt, r in through.items():
        print(f"   {rt:12} {r['ppl']:8.3f} {r['ppl_tokens_per_s']:10.1f} {r['items_per_s']:13.2f} {r['task_s']:8.1f}")
    print(f"\n   llama.cpp task scoring, the context decoded with outputs on (before) and off (now):")
    print(f"   {'file':22} {'on s':>8} {'off s':>8} {'off / on':>9}  same log-likelihoods")
    for name, r in ctx_rows.items():
        print(f"   {name:22} {r['on_s']:8.1f} {r['off_s']:8.1f} {r['off_s'] / r['on_s']:9.3f}  "
              f"{'bit for bit' if r['identical'] else 'NO'} ({r['n_loglikelihoods']} values)")
    if peer:
        ours = ours_tasks["torch"]
        print(f"\n   {'task':12} {'metric':9} {'slmedge':>9} {'lm-eval hf':>11} {'lm-eval slmedge':>16}")
        for name in tasks:
            for metric in ("acc", "acc_norm"):
                if metric not in ours[name]:
                    continue
                hf = peer["hf"]["results"].get(name, {}).get(metric)
                sl = peer["slmedge"]["results"].get(name, {}).get(metric)
                print(f"   {name:12} {metric:9} {ours[name][metric]:9.4f} {hf if hf is None else f'{hf:11.4f}'} "
                      f"{sl if sl is None else f'{sl:16.4f}'}")
        ours_s = through["torch"]["task_s"]
        print(f"\n   task time: slmedge (torch) {ours_s:.1f} s, lm-eval hf {peer['hf']['seconds']:.1f} s, "
              f"ratio {ours_s / peer['hf']['seconds']:.2f}; lm-eval via --model slmedge {peer['slmedge']['seconds']:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
