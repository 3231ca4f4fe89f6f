#!/usr/bin/env python
"""Issue 39's before/after check: the same commands on two Python stacks, their codes and numbers side by side.

    # once per stack: its python (a venv's) and the slmedge checkout it runs (PYTHONPATH)
    python benchmarks/stack_compare.py run --python /path/old/venv/bin/python --checkout /path/old/slmedge \\
        --label old --work /tmp/stack
    python benchmarks/stack_compare.py run --python .venv/bin/python --checkout . --label new --work /tmp/stack
    python benchmarks/stack_compare.py table --work /tmp/stack old new

What ``run`` does, with ``slmedge`` of that checkout on that python (every step a CLI command):
- the main job's artifact: ``slmedge compress smollm2-135m --method awq --bits 4 --group-size 32`` (asymmetric,
  32 x 512 C4 tokens: ``slmedge run``'s recipe), its GGUF (``--type q4_1``, codes kept) and int4 ONNX
  (MatMulNBits from the codes);
- perplexity of each (torch, llama.cpp, onnxruntime) on WikiText-2 and NTREX en/zh, 2 windows of 512;
- GPTQ W4 g32, SparseGPT 50% and Wanda 2:4 on one tiny random llama (made once, under --work, by the first run
  and reused by the second, so both stacks compress the very same files).

Recorded per artifact: the sha256 of every tensor of quantization.safetensors (the codes, scales, zero points,
masks) and of weights.safetensors' tensors; ``table`` prints which are identical and the perplexity ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RECIPES = {
    "awq-w4g32": ["smollm2-135m", "--method", "awq", "--bits", "4", "--group-size", "32", "--nsamples", "32",
                  "--seqlen", "512"],
}
TINY = {
    "tiny-gptq": ["--method", "gptq", "--bits", "4", "--group-size", "32", "--sym"],
    "tiny-sparsegpt": ["--method", "sparsegpt", "--sparsity", "0.5"],
    "tiny-wanda": ["--method", "wanda", "--sparsity", "2:4"],
}
PPL = ["--metrics", "perplexity", "--langs", "en,zh", "--ppl-windows", "2", "--seqlen", "512"]


def slmedge(python: str, checkout: Path, *args: str, log: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    started = time.perf_counter()
    with log.open("a") as f:
        f.write(f"$ slmedge {' '.join(args)}\n")
        f.flush()
        done = subprocess.run([python, "-m", "slmedge", *args], env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"slmedge {' '.join(args)} failed ({done.returncode}); see {log}")
    return time.perf_counter() - started


def tensor_digests(path: Path) -> dict[str, str]:
    """sha256 of each tensor's bytes in a safetensors file (its header's offsets, no library needed)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    return {name: hashlib.sha256(raw[base + info["data_offsets"][0]:base + info["data_offsets"][1]]).hexdigest()[:16]
            for name, info in sorted(header.items()) if name != "__metadata__"}


def gguf_digests(path: Path) -> dict[str, str]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {t.name: hashlib.sha256(bytes(t.data)).hexdigest()[:16] for t in reader.tensors}


def onnx_digests(folder: Path) -> dict[str, str]:
    """The MatMulNBits nodes' packed codes, scales and zero points, keyed by their own digest: exporters name
    nodes differently, so two exports hold the same codes when these sets are equal."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(sorted(folder.glob("*.onnx"))[0]), load_external_data=True)
    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for name in node.input[1:]:
                if name in inits:
                    digest = hashlib.sha256(numpy_helper.to_array(inits[name]).tobytes()).hexdigest()[:16]
                    out[digest] = digest
    return out


def perplexities(report: Path) -> dict[str, float]:
    found = json.loads(report.read_text())["metrics"]["perplexity"]
    return {k: v["perplexity"] for k, v in found.items() if isinstance(v, dict) and "perplexity" in v}


def run(args) -> None:
    work = Path(args.work)
    out = work / args.label
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.txt"
    py, co = args.python, Path(args.checkout).resolve()
    versions = subprocess.run([py, "-c", "import json, torch, transformers, tokenizers, llama_cpp, onnxruntime; "
                               "print(json.dumps({m.__name__: m.__version__ for m in (torch, transformers, tokenizers, "
                               "llama_cpp, onnxruntime)}))"], capture_output=True, text=True, check=True).stdout
    record = {"label": args.label, "versions": json.loads(versions), "artifacts": {}, "perplexity": {}, "seconds": {}}
    for name, cmd in RECIPES.items():
        art = out / name
        record["seconds"][f"compress {name}"] = slmedge(py, co, "compress", *cmd, "-o", str(art), "--overwrite", log=log)
        record["seconds"][f"gguf {name}"] = slmedge(py, co, "export", str(art), "--format", "gguf", "--type", "q4_1",
                                                    "-o", str(out / f"{name}.gguf"), "--overwrite", log=log)
        record["seconds"][f"onnx {name}"] = slmedge(py, co, "export", str(art), "--format", "onnx", "--type", "int4",
                                                    "-o", str(out / f"{name}-onnx"), "--overwrite", log=log)
        record["artifacts"][name] = {"quantization": tensor_digests(art / "quantization.safetensors"),
                                     "weights": tensor_digests(art / "weights.safetensors"),
                                     "gguf": gguf_digests(out / f"{name}.gguf"),
                                     "onnx": onnx_digests(out / f"{name}-onnx")}
        for what, path in (("torch", art), ("llama.cpp", out / f"{name}.gguf"), ("onnxruntime", out / f"{name}-onnx")):
            report = out / f"ppl-{name}-{what}.json"
            slmedge(py, co, "evaluate", str(path), *PPL, "--json", str(report), "--results-db", str(out / "r.db"), log=log)
            record["perplexity"][f"{name} {what}"] = perplexities(report)
    tiny = work / "tiny-llama"
    if not (tiny / "config.json").is_file():  # the first run makes it; the second compresses the same files
        tests = Path(__file__).resolve().parents[1] / "tests"
        subprocess.run([py, "-c", f"import sys; sys.path.insert(0, {str(tests)!r}); from tiny import "
                        f"save_tiny, calib_text; save_tiny('llama', {str(tiny)!r}, layers=4); "
                        f"calib_text({str(work / 'calib.txt')!r})"], env={**os.environ, "PYTHONPATH": str(co)}, check=True)
    for name, cmd in TINY.items():
        art = out / name
        slmedge(py, co, "compress", str(tiny), *cmd, "--calibration", str(work / "calib.txt"), "--nsamples", "8",
                "--seqlen", "32", "-o", str(art), "--overwrite", log=log)
        record["artifacts"][name] = {"quantization": tensor_digests(art / "quantization.safetensors"),
                                     "weights": tensor_digests(art / "weights.safetensors")}
    (out / "record.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {out / 'record.json'}")


def table(args) -> None:
    work = Path(args.work)
    a, b = (json.loads((work / label / "record.json").read_text()) for label in (args.before, args.after))
    print(f"| | {a['label']} | {b['label']} |\n|---|---|---|")
    for lib in sorted(set(a["versions"]) | set(b["versions"])):
        print(f"| {lib} | {a['versions'].get(lib, '-')} | {b['versions'].get(lib, '-')} |")
    print("\n| artifact | part | tensors | identical |\n|---|---|---:|---:|")
    for name in a["artifacts"]:
        for part, digests in a["artifacts"][name].items():
            other = b["artifacts"].get(name, {}).get(part, {})
            same = sum(1 for k, v in digests.items() if other.get(k) == v)
            print(f"| {name} | {part} | {len(digests)} | {same} |")
    print("\n| model | runtime | corpus | before | after | after/before |\n|---|---|---|---:|---:|---:|")
    for key, ppl in a["perplexity"].items():
        name, runtime = key.rsplit(" ", 1)
        for corpus, value in ppl.items():
            new = b["perplexity"].get(key, {}).get(corpus)
            ratio = f"{new / value:.4f}" if new else "-"
            print(f"| {name} | {runtime} | {corpus} | {value:.3f} | {new if new is None else round(new, 3)} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--python", default=sys.executable)
    r.add_argument("--checkout", default=".")
    r.add_argument("--label", required=True)
    r.add_argument("--work", required=True)
    t = sub.add_parser("table")
    t.add_argument("--work", required=True)
    t.add_argument("before")
    t.add_argument("after")
    args = parser.parse_args()
    run(args) if args.cmd == "run" else table(args)


if __name__ == "__main__":
    main()
