#!/usr/bin/env python
"""Benchmark: peak RSS and time of `slmedge export ART --format onnx`, with where the peak comes from.

    .venv/bin/python benchmarks/onnx_memory.py /tmp/o_art /tmp/o_onnx              # whole command
    .venv/bin/python benchmarks/onnx_memory.py /tmp/o_art /tmp/o_onnx --stages      # per stage

Without ``--stages``: ``slmedge export ART --format onnx --type TYPE -o OUT --overwrite`` in a
child process; its peak RSS is the kernel's high-water mark of that process (ru_maxrss from
wait4, i.e. VmHWM), its time the wall clock.

With ``--stages``: ``export_onnx`` runs in a child interpreter in which the export's steps
(building the stub model, torch.onnx tracing, onnx.load,
placing codes, the head quantizer, saving, the verification's torch and onnxruntime halves) are
wrapped; a thread samples VmRSS every 10 ms and charges each sample to the innermost running
step. Printed per step: calls, wall seconds, RSS at entry and the largest RSS seen inside it (in
GB, 1e9 bytes), then the process's VmHWM. Steps that do not exist in the code being measured are
simply not wrapped, so the same script measures the export before and after a change.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import json, os, sys, threading, time, functools, importlib
sys.path.insert(0, %(root)r)

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0

def hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0

stack, stats, order = [], {}, []
lock = threading.Lock()

def sampler():
    while True:
        r = rss()
        with lock:
            for name in stack:
                s = stats[name]
                s["max"] = max(s["max"], r)
        time.sleep(0.01)

threading.Thread(target=sampler, daemon=True).start()

def wrap(modname, attr, label):
    try:
        mod = importlib.import_module(modname)
        if "." in attr:  # Class.method
            cls_name, attr = attr.split(".")
            mod = getattr(mod, cls_name)
        fn = getattr(mod, attr)
    except Exception:
        return
    if getattr(fn, "_bench", False):
        return
    @functools.wraps(fn)
    def inner(*a, **k):
        with lock:
            if label not in stats:
                stats[label] = {"calls": 0, "seconds": 0.0, "entry": 0, "max": 0}
                order.append(label)
            s = stats[label]
            s["calls"] += 1
            s["entry"] = max(s["entry"], rss())
            stack.append(label)
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            with lock:
                s["seconds"] += time.perf_counter() - t
                s["max"] = max(s["max"], rss())
                stack.remove(label)
    inner._bench = True
    setattr(mod, attr, inner)

STEPS = [
    ("slmedge.export.onnx", "open_export_source", "open the artifact (checksums, codes)"),
    ("slmedge.compress.artifact", "Artifact.layers", "  read every linear's codes"),
    ("slmedge.export.onnx", "torch_model", "torch model (fp32, whole)"),
    ("slmedge.export.onnx_stub", "build_stub_model", "stub model (no linear weights)"),
    ("slmedge.export.onnx_stub", "trace_decoder", "trace (all)"),
    ("torch.onnx", "export", "  torch.onnx.export (tracing + proto + write)"),
    ("onnx", "load", "onnx.load"),
    ("onnx", "load_model", "onnx.load"),
    ("slmedge.export.onnx", "_load_weights", "artifact weights, fp32 (for the value check)"),
    ("slmedge.export.onnx", "place_codes", "place_codes"),
    ("slmedge.export.onnx", "place_weights", "place weights / codes"),
    ("slmedge.export.onnx", "untie_head", "untie_head"),
    ("slmedge.export.onnx", "ort_quantize_matmuls", "head: onnxruntime 8-bit quantizer"),
    ("slmedge.export.onnx", "embeddings_to_fp16", "embedding -> fp16"),
    ("slmedge.export.onnx", "_save", "save model.onnx"),
    ("onnx", "save_model", "  onnx.save_model"),
    ("slmedge.export.onnx", "verify_against_torch", "verification (all)"),
    ("slmedge.export.onnx", "torch_logits", "  torch reference logits"),
    ("slmedge.export.onnx", "streamed_logits", "  torch reference logits (streamed)"),
    ("slmedge.export.onnx", "reference_logits", "  torch reference logits"),
    ("slmedge.backends.ort", "OrtDecoder", "  onnxruntime session + logits"),
    ("slmedge.export.onnx", "_op_counts", "op counts"),
]
import slmedge.export.onnx  # noqa: E402
for m, a, l in STEPS:
    wrap(m, a, l)
# slmedge.export.onnx imports torch.onnx and OrtDecoder inside the call.
from slmedge.export.onnx import export_onnx
t0 = time.perf_counter()
report = export_onnx(%(art)r, %(out)r, %(otype)r, overwrite=True)
total = time.perf_counter() - t0
print(json.dumps({"order": order, "stats": stats, "hwm": hwm(), "seconds": total,
                  "bytes": report["bytes"], "codes_kept": report["codes_kept"],
                  "verification": {k: report["verification"][k] for k in ("mean_kl", "top1_agreement")}
                  if report.get("verification") else None}))
'''


def whole(art: str, out: str, otype: str) -> dict:
    cmd = [str(ROOT / ".venv" / "bin" / "slmedge"), "export", art, "--format", "onnx", "--type", otype, "-o", out,
           "--overwrite"]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = proc.communicate()[0]
    _, status, usage = os.wait4(proc.pid, 0) if proc.returncode is None else (None, 0, None)
    seconds = time.perf_counter() - t
    if usage is None:  # communicate() reaped it; ask the kernel for the children's maximum
        import resource

        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    else:
        peak = usage.ru_maxrss * 1024
    return {"cmd": " ".join(cmd), "rc": proc.returncode, "seconds": round(seconds, 1), "peak_rss_gb": peak / 1e9,
            "tail": output[-600:]}


def staged(art: str, out: str, otype: str) -> dict:
    code = CHILD % {"root": str(ROOT), "art": art, "out": out, "otype": otype}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("out")
    ap.add_argument("--type", default="int4")
    ap.add_argument("--stages", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.stages:
        r = staged(a.artifact, a.out, a.type)
        print(f"{'step':52s} {'calls':>5s} {'s':>7s} {'entry GB':>9s} {'max GB':>7s}")
        for name in r["order"]:
            s = r["stats"][name]
            print(f"{name:52s} {s['calls']:5d} {s['seconds']:7.1f} {s['entry'] / 1e9:9.2f} {s['max'] / 1e9:7.2f}")
        print(f"VmHWM {r['hwm'] / 1e9:.2f} GB, {r['seconds']:.1f} s, model.onnx* {r['bytes'] / 1e9:.3f} GB, "
              f"codes kept {r['codes_kept']}, verification {r['verification']}")
    else:
        r = whole(a.artifact, a.out, a.type)
        print(f"{r['cmd']}\nrc {r['rc']}, {r['seconds']} s, peak RSS {r['peak_rss_gb']:.2f} GB")
        if r["rc"]:
            print(r["tail"])
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
