#!/usr/bin/env python
"""Benchmark (issue 39): three ways to make the ONNX decoder without optimum-onnx, measured side by side.

    .venv/bin/python benchmarks/onnx_candidates.py MODEL_FOLDER --work /tmp/onnx-cand
    .venv/bin/python benchmarks/onnx_candidates.py /tmp/phi --work /tmp/onnx-cand --candidates tracer,builder --no-score

MODEL_FOLDER is a Hugging Face folder with safetensors weights (for SmolLM2-135M, the folder slmedge
converts its embedded GGUF into: ``slmedge inspect smollm2-135m`` names it; for Phi-3.5-mini's shape, a
random model from ``scripts/make_random_model.py``). Each candidate writes an fp32 decoder with its KV cache
as inputs and outputs (the part optimum-onnx did; placing MatMulNBits codes or fp16 weights comes after,
the same for every candidate):

- tracer:  slmedge's way (``slmedge export MODEL --format onnx --type fp32 --no-verify``): torch.onnx's
           TorchScript exporter around a model whose linears are stubs, weights placed one at a time.
- dynamo:  ``torch.onnx.export(..., dynamo=True)`` (torch.export + onnxscript) around the whole fp32 model,
           the same inputs and outputs.
- builder: onnxruntime-genai's model builder (``python -m onnxruntime_genai.models.builder -p fp32 -e cpu``),
           which writes the graph from the weights with onnx-ir.

Each runs in its own child process, one after the other (2 cores: never two at once); recorded: wall time,
peak RSS (the kernel's ru_maxrss of the child and its waited-for descendants; a watchdog kills the group
above --max-rss-gb), bytes on disk, node count. Then each graph is scored in onnxruntime against the
model's own logits in torch (fp32, eager attention) on a fixed probe: max |logit difference| and top-1
agreement, and the speed of greedy decoding through the KV cache (--tokens new tokens after a 64-token
prompt, median of --repeats). The machine's load average is printed: on shared cores the wall times are
those of a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = ("tracer", "dynamo", "builder")


# ----------------------------------------------------------------------------- children

def export_dynamo(model_dir: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    config = model.config
    layers = int(config.num_hidden_layers)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)

    class Flat(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, past):
            cache = DynamicCache()
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            o = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=cache, use_cache=True)
            present = []
            for layer in o.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (o.logits, *present)

    kv = [(i, w) for i in range(layers) for w in ("key", "value")]
    batch, new, old = 2, 5, 3
    ids = torch.randint(0, int(config.vocab_size), (batch, new))
    mask = torch.ones(batch, old + new, dtype=torch.int64)
    pos = torch.arange(old, old + new).expand(batch, new).contiguous()
    past = [torch.zeros(batch, kv_heads, old, head_dim) for _ in kv]
    d = torch.export.Dim.DYNAMIC
    shapes = ({0: d, 1: d}, {0: d, 1: d}, {0: d, 1: d}, [{0: d, 2: d} for _ in kv])
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        program = torch.onnx.export(Flat(model), (ids, mask, pos, past), dynamo=True, dynamic_shapes=shapes,
                                    input_names=["input_ids", "attention_mask", "position_ids",
                                                 *(f"past_key_values.{i}.{w}" for i, w in kv)],
                                    output_names=["logits", *(f"present.{i}.{w}" for i, w in kv)],
                                    opset_version=18, external_data=True)
    program.save(str(out / "model.onnx"), external_data=True)


def child(kind: str, model_dir: Path, out: Path, precision: str, tracer_source: Path) -> None:
    if kind == "tracer":
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-m", "slmedge", "export", str(tracer_source), "--format", "onnx",
                        "--type", precision, "--no-verify", "-o", str(out)], check=True, env=env)
    elif kind == "dynamo":
        export_dynamo(model_dir, out)
    elif kind == "builder":
        cache = out.parent / f"{out.name}-cache"
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(model_dir), "-o", str(out),
                        "-p", precision, "-e", "cpu", "-c", str(cache)], check=True)
        shutil.rmtree(cache, ignore_errors=True)


def score(model_dir: Path, outs: dict, tokens: int, repeats: int) -> dict:
    import numpy as np
    import onnxruntime as ort
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    config = model.config
    vocab = int(config.vocab_size)
    probe = torch.randint(0, vocab, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(probe).logits[0].numpy()
    del model
    results = {}
    for name, folder in outs.items():
        files = sorted(Path(folder).glob("*.onnx"))
        if not files:
            results[name] = {"error": "no .onnx file"}
            continue
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        session = ort.InferenceSession(str(files[0]), options, providers=["CPUExecutionProvider"])
        inputs = {i.name: i for i in session.get_inputs()}
        past_names = [n for n in inputs if n.startswith("past_key_values.")]
        kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        np_dtype = np.float16 if "float16" in inputs[past_names[0]].type else np.float32
        outputs = [o.name for o in session.get_outputs()]

        def run(ids, past, start):
            feed = {"input_ids": ids.astype(np.int64)}
            total = start + ids.shape[1]
            if "attention_mask" in inputs:
                feed["attention_mask"] = np.ones((1, total), dtype=np.int64)
            if "position_ids" in inputs:
                feed["position_ids"] = np.arange(start, total, dtype=np.int64)[None]
            feed.update({n: past[n] for n in past_names})
            got = session.run(None, feed)
            by = dict(zip(outputs, got))
            nxt = {n: by[n.replace("past_key_values.", "present.")] for n in past_names}
            return by["logits"], nxt

        empty = {n: np.zeros((1, kv_heads, 0, head_dim), dtype=np_dtype) for n in past_names}
        logits, _ = run(probe.numpy(), empty, 0)
        logits = logits[0].astype(np.float32)
        entry = {"max_abs_logit_diff": float(np.abs(logits - want).max()),
                 "top1_agreement": float((logits.argmax(-1) == want.argmax(-1)).mean())}
        speeds = []
        for _ in range(repeats):
            lg, past = run(probe.numpy(), empty, 0)
            nxt = lg[:, -1:].argmax(-1)
            t = time.perf_counter()
            for k in range(tokens):
                lg, past = run(nxt, past, 64 + k)
                nxt = lg[:, -1:].argmax(-1)
            speeds.append(tokens / (time.perf_counter() - t))
        entry["decode_tokens_per_s"] = round(statistics.median(speeds), 1)
        results[name] = entry
    return results


# ----------------------------------------------------------------------------- parent

def measured(cmd: list[str], max_rss_gb: float) -> dict:
    import psutil

    t = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = []

    def watch():
        while proc.poll() is None:
            try:
                group = [p for p in psutil.process_iter(["pid"]) if os.getpgid(p.pid) == proc.pid]
                rss = sum(p.memory_info().rss for p in group)
            except (psutil.Error, ProcessLookupError):
                rss = 0
            if rss > max_rss_gb * 1e9:
                killed.append(round(rss / 1e9, 2))
                os.killpg(proc.pid, signal.SIGKILL)
                return
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()
    chunks = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own high-water mark, not the run's
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join()
    output = chunks[0] if chunks else ""
    wall = time.perf_counter() - t
    row = {"seconds": round(wall, 1), "peak_rss_gb": round(usage.ru_maxrss / 1e6, 2), "rc": proc.returncode}
    if killed:
        row["killed_at_gb"] = killed[0]
    if proc.returncode:
        row["tail"] = output[-600:]
    return row


def folder_stats(folder: Path) -> dict:
    import onnx

    files = sorted(folder.glob("*.onnx"))
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.suffix in ("", ".onnx", ".data")
               or p.name.endswith((".onnx_data", ".onnx.data")))
    nodes = len(onnx.load(str(files[0]), load_external_data=False).graph.node) if files else None
    return {"bytes": size, "nodes": nodes}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        child(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), sys.argv[5], Path(sys.argv[6]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_score":
        outs = json.loads(sys.argv[3])
        print(json.dumps(score(Path(sys.argv[2]), outs, int(sys.argv[4]), int(sys.argv[5]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--precision", choices=("fp32", "int4"), default="fp32",
                    help="int4: the tracer exports --tracer-source (an RTN artifact: its codes placed as MatMulNBits) "
                         "and the builder quantizes with its own int4 RTN; dynamo always writes fp32")
    ap.add_argument("--tracer-source", type=Path, default=None, help="what the tracer exports (default: MODEL)")
    ap.add_argument("--max-rss-gb", type=float, default=14.0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-score", action="store_true", help="export only (a random model's logits say nothing)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    names = [c for c in args.candidates.split(",") if c]
    unknown = set(names) - set(CANDIDATES)
    if unknown:
        ap.error(f"unknown candidate(s): {', '.join(sorted(unknown))}; choose from {', '.join(CANDIDATES)}")
    args.work.mkdir(parents=True, exist_ok=True)
    rows, outs = {}, {}
    for name in names:
        out = args.work / name
        shutil.rmtree(out, ignore_errors=True)
        load = os.getloadavg()[0]
        row = measured([sys.executable, __file__, "_child", name, str(args.model), str(out), args.precision,
                        str(args.tracer_source or args.model)], args.max_rss_gb)
        row["load_before"] = round(load, 2)
        if row["rc"] == 0 and out.is_dir():
            row.update(folder_stats(out))
            outs[name] = str(out)
        rows[name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "tail"}), flush=True)
        if "tail" in row:
            print("   ", row["tail"].strip().splitlines()[-1][:300] if row["tail"].strip() else "", flush=True)
    if outs and not args.no_score:
        done = subprocess.run([sys.executable, __file__, "_score", str(args.model), json.dumps(outs), str(args.tokens),
                               str(args.repeats)], capture_output=True, text=True)
        if done.returncode:
            print("scoring failed:", done.stderr[-1500:])
        else:
            for name, entry in json.loads(done.stdout.strip().splitlines()[-1]).items():
                rows[name].update(entry)
    print(f"\n| candidate | export s | peak RSS GB | MB on disk | nodes | max abs logit diff | top-1 | decode tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        status = "" if r["rc"] == 0 else (f" (killed at {r['killed_at_gb']} GB)" if "killed_at_gb" in r else " (failed)")
        mb = f"{r['bytes'] / 1e6:.1f}" if "bytes" in r else "-"
        diff = f"{r['max_abs_logit_diff']:.2e}" if "max_abs_logit_diff" in r else "-"
        top1 = f"{r['top1_agreement']:.1%}" if "top1_agreement" in r else "-"
        print(f"| {name}{status} | {r['seconds']} | {r['peak_rss_gb']} | {mb} | {r.get('nodes', '-')} | {diff} | {top1} "
              f"| {r.get('decode_tokens_per_s', '-')} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
