#!/usr/bin/env python
"""Benchmark: slmedge's GGUF files against `llama-imatrix` + `llama-quantize` on the same calibration text.

What a llama.cpp user gets for free, measured side by side with what slmedge writes, per model:

1. llama.cpp's tools, built from the llama.cpp source vendored in the installed llama-cpp-python's
   sdist (``llama-imatrix``, ``llama-quantize``; cached under ``--tools``, a few minutes once).
2. The base: ``slmedge export MODEL --format gguf --type f16``.
3. The calibration text: the windows ``slmedge compress`` samples (``--calibration``, slmedge's default
   unless given; ``--nsamples`` x ``--seqlen`` tokens, seed 0), decoded and written one after the other; ``llama-imatrix -c SEQLEN --chunks
   NSAMPLES`` re-tokenizes them (the token count it saw is printed).
4. Importance matrices: llama.cpp's (``llama-imatrix`` on the f16 base) and slmedge's
   (``slmedge imatrix`` on the model, the same windows).
5. Files: llama.cpp's ``llama-quantize --imatrix`` of the base to each ``--types`` (Q3_K_M IQ4_XS Q4_0
   Q4_1 Q4_K_M Q5_K_M Q6_K) and Q4_0 without one; the same types by ``llama-quantize`` with slmedge's
   matrix (llama.cpp reading slmedge's file: the interoperability check) and by ``slmedge export
   --imatrix`` (slmedge's own path to llama.cpp's quantizer); slmedge's calibrated methods with their
   codes kept (``--methods``: RTN/GPTQ W4 g32 sym -> Q4_0, AWQ/RTN W4 g32 asym -> Q4_1, on llama.cpp's
   grids, or mixed to a bits-per-weight budget); with ``--match-sizes``, a method mixed to each llama.cpp
   imatrix file's own bits per weight (a hair under), so every size has a slmedge file no larger.
6. Every file scored by ``slmedge evaluate`` in llama.cpp: mean KL and top-1 against the base model
   in torch (``--fidelity-windows`` x 512 WikiText-2 tokens), perplexity in the shipped languages
   and WikiText-2 (geometric mean), decode tokens/s (``--latency``).
7. With ``--latency``: decode speed of slmedge's files against llama.cpp's imatrix file of the same block
   types (IQ4_XS, Q4_0, Q4_1, Q6_K), measured in turns over ``--decode-rounds`` rounds (the ratio).

The table is printed (markdown) and written with every number to ``WORK/MODEL/results.json``, and
after it the goal: for each llama.cpp imatrix file, slmedge's file of equal or smaller size that is
lower on both mean KL and perplexity (or the nearest miss), caveat rows marked.
Caveat printed with it: the embedded models' only weights are a Q4_1 GGUF (SmolLM2) and a Q4_K_M one
(Gemma 3): a quantizer that lands on those grids looks better than it would on a 16-bit model.

Runs one step after another (never two timed things at once). Resumable: a file or score already
in WORK is reused when its inputs are unchanged (each step's inputs are in its ``.json`` beside it;
everything slmedge made or scored counts slmedge's own source among them, so a changed slmedge
makes its files and all scores again, and llama.cpp's files when the base or the text changed).

    .venv/bin/python benchmarks/gguf_peers.py                       # both embedded models, all rows
    .venv/bin/python benchmarks/gguf_peers.py --models smollm2-135m --nsamples 32 --methods none
    .venv/bin/python benchmarks/gguf_peers.py --types Q4_K_M Q5_K_M --methods none --match-sizes gptq rtn-q4_k+q6_k
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TYPES = ("Q3_K_M", "IQ4_XS", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K")
METHODS = {  # label -> (compress options, export type); "auto": each linear in its own grid's type
    "rtn-sym": (["--method", "rtn", "--bits", "4", "--group-size", "32", "--sym"], "q4_0"),
    "gptq-sym": (["--method", "gptq", "--bits", "4", "--group-size", "32", "--sym"], "q4_0"),
    "awq-asym": (["--method", "awq", "--bits", "4", "--group-size", "32", "--asym"], "q4_1"),
    "rtn-asym": (["--method", "rtn", "--bits", "4", "--group-size", "32", "--asym"], "q4_1"),
    # On llama.cpp's grids (--grid), each block's scale searched by importance; --bpw mixes them.
    **{f"{m}-{g}": (["--method", m, "--grid", g], "auto")
       for m in ("rtn", "gptq", "awq") for g in ("q3_k", "iq4_xs", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k")},
}  # and METHOD-bpwB for any budget B (main() adds the ones asked for)
DEFAULT_METHODS = ("gptq-sym", "awq-asym", "rtn-q4_0", "gptq-q3_k", "gptq-iq4_xs", "awq-iq4_xs", "gptq-q4_0",
                   "awq-q4_1", "gptq-q4_k", "awq-q4_k", "gptq-q5_k", "gptq-q6_k")
CAVEAT = {"smollm2-135m": "Q4_1", "gemma3-270m": "Q4_K_M"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list, what: str, log_file: Path | None = None, env=None) -> None:
    log(f"{what}: {' '.join(str(c) for c in cmd)}")
    started = time.perf_counter()
    with open(log_file, "w") if log_file else open(os.devnull, "w") as out:
        rc = subprocess.run([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise SystemExit(f"error: {what} failed (exit {rc}){f'; see {log_file}' if log_file else ''}")
    log(f"{what}: {time.perf_counter() - started:.1f} s")


def slmedge(*args) -> list:
    return [sys.executable, "-m", "slmedge", *map(str, args)]


# --- llama.cpp's tools -------------------------------------------------------------------------


def build_tools(root: Path, jobs: int) -> dict[str, Path]:
    """llama-imatrix and llama-quantize from the installed llama-cpp-python's own sdist."""
    import importlib.metadata as md

    version = md.version("llama-cpp-python")
    home = root / version
    tools = {t: home / "build" / "bin" / t for t in ("llama-imatrix", "llama-quantize")}
    if all(p.is_file() for p in tools.values()):
        return tools
    src = home / "src"
    if not (src / "ok").is_file():
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", src,
             f"llama-cpp-python=={version}"], f"llama-cpp-python {version} sdist")
        with tarfile.open(next(src.glob("llama_cpp_python-*.tar.gz"))) as tar:
            tar.extractall(src, filter="data")
        (src / "ok").touch()
    vendor = next(src.glob("llama_cpp_python-*/vendor/llama.cpp"))
    build = home / "build"
    run(["cmake", "-S", vendor, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
         "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
         "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"], "cmake configure",
        home / "configure.log")
    run(["cmake", "--build", build, "--target", "llama-imatrix", "llama-quantize", "-j", str(jobs)],
        "build llama-imatrix, llama-quantize (minutes, once)", home / "build.log")
    return tools


# --- steps, each reused while its inputs are unchanged -----------------------------------------


CODE = ""  # slmedge's source digest (main sets it): part of the inputs of everything slmedge computes


def fresh(out: Path, inputs: dict) -> bool:
    stamp = out.with_name(out.name + ".inputs.json")
    return out.exists() and stamp.is_file() and json.loads(stamp.read_text()) == inputs


def stamp(out: Path, inputs: dict) -> None:
    out.with_name(out.name + ".inputs.json").write_text(json.dumps(inputs, sort_keys=True))


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def calibration_text(model: str, out: Path, spec: str, nsamples: int, seqlen: int) -> int:
    """The windows slmedge compress samples, decoded one after the other; returns their token count."""
    from slmedge.data.calibration import load_calibration
    from slmedge.models.source import load

    loaded = load(model)
    calib = load_calibration(spec, loaded.tokenizer, nsamples, seqlen, 0)
    text = "".join(loaded.tokenizer.decode(row, skip_special_tokens=True) for row in calib.tokens.tolist())
    out.write_text(text, encoding="utf-8")
    return int(calib.tokens.numel())


def compare_imatrices(ours: Path, theirs: Path) -> dict:
    """How slmedge's importance matrix agrees with llama-imatrix's on the same windows: per tensor the
    relative difference of the per-column means (median over columns), then its median and maximum
    over tensors, and the Pearson correlation of the log means."""
    import numpy as np

    from slmedge.export.imatrix import read_imatrix

    a, _ = read_imatrix(ours)
    b, _ = read_imatrix(theirs)
    common = sorted(set(a) & set(b))
    rel, corr = [], []
    for name in common:
        x, y = a[name].astype(np.float64), b[name].astype(np.float64)
        rel.append(float(np.median(np.abs(x - y) / np.maximum(np.abs(y), 1e-12))))
        corr.append(float(np.corrcoef(np.log(x + 1e-12), np.log(y + 1e-12))[0, 1]))
    return {"ours": len(a), "theirs": len(b), "common": len(common),
            "median_rel_diff": float(np.median(rel)) if rel else None, "max_rel_diff": max(rel) if rel else None,
            "min_log_corr": min(corr) if corr else None}


def tokens_seen(log_file: Path) -> str:
    """llama-imatrix's own account of the text it was given (its log's tokenizing/chunk lines)."""
    lines = [ln.split(" I ", 1)[-1].strip() for ln in log_file.read_text(errors="replace").splitlines()
             if "computing over" in ln or "tokenization took" in ln]
    return "; ".join(lines)


def scored(path: Path, out: Path, file_digest: str, size: int, model: str, args, runtime: str | None = None,
           json_path: Path | None = None, reuse=None) -> dict:
    """One file's scores (``out``, reused while its inputs are unchanged): ``slmedge evaluate`` in
    ``runtime`` (default: the file's own) against ``model`` in torch: mean KL, top-1, perplexity per
    language and their geometric mean, with ``args.latency`` prefill and decode tokens/s (128 + 32 tokens,
    2 repeats). The GGUF, ONNX and ExecuTorch comparisons score every row with it; ``reuse`` (default
    ``fresh``) says whether ``out`` may be reused for these inputs."""
    inputs = {"file": file_digest, "reference": model, "fidelity_windows": args.fidelity_windows,
              "ppl_windows": args.ppl_windows, "latency": args.latency, "threads": args.threads, "slmedge": CODE}
    if (reuse or fresh)(out, inputs):
        return json.loads(out.read_text())
    from slmedge.evaluate.api import EvalSettings, evaluate

    log(f"score {path.name}")
    started = time.perf_counter()
    metrics = ("fidelity", "perplexity") + (("latency",) if args.latency else ())
    res = evaluate(str(path), EvalSettings(metrics=metrics, reference=model, runtime=runtime,
                                           fidelity_windows=args.fidelity_windows, ppl_windows=args.ppl_windows,
                                           pp=128, tg=32, repeats=2, threads=args.threads), json_path=json_path)
    log(f"score {path.name}: {time.perf_counter() - started:.1f} s")
    m = res["metrics"]
    fid = m.get("fidelity") or {}
    ppl = {k: v["perplexity"] for k, v in (m.get("perplexity") or {}).items() if isinstance(v, dict) and "perplexity" in v}
    lat = m.get("latency") or {}
    row = {"bytes": size, "mean_kl": fid.get("kl_mean"), "top1": fid.get("top1_agreement"),
           "ppl": ppl, "ppl_geomean": math.exp(sum(math.log(v) for v in ppl.values()) / len(ppl)) if ppl else None,
           "prefill_tps": (lat.get("prefill_tps") or {}).get("median"),
           "decode_tps": (lat.get("decode_tps") or {}).get("median"), "runtime": res.get("runtime")}
    out.write_text(json.dumps(row, indent=2))
    stamp(out, inputs)
    return row


def score(file: Path, model: str, work: Path, args) -> dict:
    return scored(file, file.with_name(file.name + ".score.json"), digest(file), file.stat().st_size, model, args,
                  json_path=file.with_name(file.name + ".eval.json"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--types", nargs="+", default=list(TYPES))
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), help=f"{', '.join(METHODS)}, any "
                    "METHOD-bpwB (a mix to B bits per weight), METHOD-bpwB-G1+G2+... (a mix of those grids only), or none")
    ap.add_argument("--calibration", default=None, help="calibration spec for both tools (default: slmedge's)")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--ppl-windows", type=int, default=4)
    ap.add_argument("--fidelity-windows", type=int, default=4)
    ap.add_argument("--latency", action="store_true", help="also decode tokens/s (llama.cpp, 128 + 32 tokens), and "
                    "slmedge's files against llama.cpp's of the same block types in turns")
    ap.add_argument("--decode-rounds", type=int, default=5, help="rounds of the same-type decode comparison")
    ap.add_argument("--no-interop", dest="interop", action="store_false", help="leave out the rows made with "
                    "slmedge's importance matrix (llama-quantize reading it, slmedge export --imatrix): the comparison alone")
    ap.add_argument("--match-sizes", nargs="+", default=[], metavar="METHOD[-G1+G2...]", help="also, per llama.cpp "
                    "imatrix file, METHOD mixed to that file's bits per weight of the linears (a hair under: "
                    "METHOD-bpwB with B from the file), so every size has a slmedge file of equal or smaller size; "
                    "with grids, a mix of those only (gptq-q4_k+q6_k)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--work", type=Path, default=ROOT / ".bench" / "gguf")
    ap.add_argument("--tools", type=Path, default=ROOT / ".bench" / "llama-tools")
    args = ap.parse_args()
    methods = [m for m in args.methods if m != "none"]
    for m in methods:
        add_budget_method(m)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"error: --methods: unknown {unknown[0]}; choose from {', '.join(METHODS)}, METHOD-bpwB[-G1+G2...] or none")
    for spec in args.match_sizes:
        if not re.fullmatch(MATCH_SPEC, spec):
            raise SystemExit(f"error: --match-sizes: {spec!r} is not rtn, gptq or awq, optionally with grids (gptq-q4_k+q6_k)")
    from slmedge.compress.recipe import Recipe
    from slmedge.data.calibration import calibration_sources
    from slmedge.errors import DataError
    from slmedge.study.inputs import slmedge_digest

    global CODE
    CODE = slmedge_digest()  # every file and score slmedge made is made again after its code changed

    args.calibration = args.calibration or Recipe.calibration
    try:
        calibration_sources(args.calibration)  # an unknown name or a missing file: its message, before any work
    except DataError as exc:
        raise SystemExit(f"error: --calibration: {exc}") from None
    tools = build_tools(args.tools, args.threads)
    summary = {}
    for model in args.models:
        work = args.work / model
        (work / "logs").mkdir(parents=True, exist_ok=True)
        files: dict[str, tuple[str, Path]] = {}  # row label -> (producer, file)
        base = work / "base-f16.gguf"
        if not fresh(base, {"model": model, "slmedge": CODE}):
            run(slmedge("export", model, "--format", "gguf", "--type", "f16", "-o", base, "--overwrite"),
                "base f16 GGUF", work / "logs" / "base.log")
            stamp(base, {"model": model, "slmedge": CODE})
        calib = work / "calibration.txt"
        cal_inputs = {"model": model, "calibration": args.calibration, "nsamples": args.nsamples, "seqlen": args.seqlen,
                      "slmedge": CODE}
        if not fresh(calib, cal_inputs):
            calibration_text(model, calib, args.calibration, args.nsamples, args.seqlen)
            stamp(calib, cal_inputs)
        llama_imx = work / "llama.imatrix.gguf"
        if not fresh(llama_imx, {"base": digest(base), **cal_inputs}):
            run([tools["llama-imatrix"], "-m", base, "-f", calib, "-o", llama_imx, "-c", args.seqlen, "--chunks",
                 args.nsamples, "-t", args.threads, "--no-ppl"], "llama-imatrix", work / "logs" / "llama-imatrix.log")
            stamp(llama_imx, {"base": digest(base), **cal_inputs})
        ours_imx = work / "slmedge.imatrix.gguf"
        if not fresh(ours_imx, cal_inputs):
            run(slmedge("imatrix", model, "-o", ours_imx, "--calibration", args.calibration, "--nsamples",
                        args.nsamples, "--seqlen", args.seqlen, "--overwrite"), "slmedge imatrix", work / "logs" / "slmedge-imatrix.log")
            stamp(ours_imx, cal_inputs)
        agreement = compare_imatrices(ours_imx, llama_imx)
        log(f"importance matrices: {json.dumps(agreement)}; llama-imatrix: "
            f"{tokens_seen(work / 'logs' / 'llama-imatrix.log') if (work / 'logs' / 'llama-imatrix.log').is_file() else '?'}")
        quantized = [("Q4_0", None)] + [(t, "llama") for t in args.types] + [(t, "slmedge") for t in args.types
                                                                             if args.interop]
        for qtype, matrix in quantized:
            label = f"{qtype} " + {None: "no imatrix", "llama": "llama-imatrix", "slmedge": "slmedge imatrix"}[matrix]
            out = work / f"llama-{qtype.lower()}-{matrix or 'plain'}.gguf"
            inputs = {"base": digest(base), "type": qtype, "imatrix": digest(llama_imx if matrix == "llama" else
                                                                             ours_imx) if matrix else None}
            if not fresh(out, inputs):
                cmd = [tools["llama-quantize"]] + (["--imatrix", llama_imx if matrix == "llama" else ours_imx]
                                                   if matrix else []) + [base, out, qtype, args.threads]
                run(cmd, f"llama-quantize {label}", work / "logs" / f"{out.name}.log")
                stamp(out, inputs)
            files[label] = ("llama.cpp", out)
        for qtype in args.types if args.interop else ():  # slmedge's own path to llama.cpp's quantizer, its matrix
            out = work / f"slmedge-{qtype.lower()}-imatrix.gguf"
            inputs = {"model": model, "type": qtype, "imatrix": digest(ours_imx), "slmedge": CODE}
            if not fresh(out, inputs):
                run(slmedge("export", model, "--format", "gguf", "--type", qtype.lower(), "--imatrix", ours_imx, "-o",
                            out, "--overwrite", "--no-verify"), f"slmedge export {qtype} --imatrix",
                    work / "logs" / f"{out.name}.log")
                stamp(out, inputs)
            files[f"{qtype} slmedge export --imatrix"] = ("slmedge", out)
        matched = []  # --match-sizes: a budget at each llama.cpp imatrix file's size
        for qtype in args.types:
            for spec in args.match_sizes:
                label = matched_method(spec, work / f"llama-{qtype.lower()}-llama.gguf")
                if label is not None and label not in methods + matched:
                    matched.append(label)
        for label in methods + matched:
            opts, qtype = METHODS[label]
            art = work / f"artifact-{label}"
            out = work / f"slmedge-{label}-{qtype}.gguf"
            inputs = {"model": model, "opts": opts, "calibration": args.calibration, "nsamples": args.nsamples,
                      "seqlen": args.seqlen, "type": qtype, "slmedge": CODE}
            if not fresh(out, inputs):
                run(slmedge("compress", model, *opts, "--calibration", args.calibration, "--nsamples", args.nsamples,
                            "--seqlen", args.seqlen, "-o", art, "--overwrite"), f"compress {label}", work / "logs" / f"compress-{label}.log")
                run(slmedge("export", art, "--format", "gguf", "--type", qtype, "--exact", "-o", out, "--overwrite",
                            "--no-verify"), f"export {label} {qtype}", work / "logs" / f"{out.name}.log")
                shutil.rmtree(art, ignore_errors=True)
                stamp(out, inputs)
            files[f"{qtype.upper()} {label} g32, codes kept" if qtype != "auto" else f"{label}, codes kept"] = \
                ("slmedge", out)
        rows = {}
        for label, (producer, file) in files.items():
            rows[label] = {"producer": producer, "file": file.name, **score(file, model, work, args),
                           "on_base_grid": on_base_grid(file, model)}
        summary[model] = rows
        print_table(model, rows)
        goal = goal_rows(rows)
        print_goal(model, goal, rows)
        speeds = decode_pairs(rows, work, model, args) if args.latency else {}
        (work / "results.json").write_text(json.dumps({"model": model, "args": {k: str(v) for k, v in vars(args).items()},
                                                       "imatrix_agreement": agreement, "rows": rows, "goal": goal,
                                                       "decode_pairs": speeds}, indent=2))
    return 0


BUDGET = r"(rtn|gptq|awq)-bpw(\d+(?:\.\d+)?)(?:-([a-z0-9_]+(?:\+[a-z0-9_]+)*))?"
MATCH_SPEC = r"(rtn|gptq|awq)(?:-([a-z0-9_]+(?:\+[a-z0-9_]+)*))?"
MATCH_MARGIN = 0.0005  # bits per weight a matched budget stays under llama.cpp's file: room for slmedge's manifest


def add_budget_method(label: str) -> None:
    """Register METHOD-bpwB[-G1+G2...] (gptq-bpw4.9, awq-bpw5.25, gptq-bpw4.9-q4_k+q5_k+q6_k: those grids only)."""
    found = re.fullmatch(BUDGET, label)
    if found and label not in METHODS:
        METHODS[label] = (["--method", found[1], "--bpw", found[2]] +
                          (["--bpw-grids", found[3].replace("+", ",")] if found[3] else []), "auto")


def linears(file: Path) -> tuple[float, dict[str, tuple[int, int]]]:
    """Bits per weight of a GGUF's linears as stored (the 2-D tensors of its blocks: what --bpw budgets),
    and their (rows, columns)."""
    import gguf

    found = [t for t in gguf.GGUFReader(file).tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    bpw = sum(int(t.n_bytes) * 8 for t in found) / sum(int(t.n_elements) for t in found)
    return bpw, {t.name: (int(t.shape[1]), int(t.shape[0])) for t in found}


def matched_method(spec: str, theirs: Path) -> str | None:
    """``spec`` (METHOD or METHOD-G1+G2...) as a budget method at ``theirs``'s bits per weight of the linears,
    MATCH_MARGIN under it and rounded down to 3 decimals (the budget lands within 1% below that); None
    where those grids cannot reach it (slmedge's own check, said in the log)."""
    from slmedge.compress.budget import check_budget
    from slmedge.errors import ConfigError

    found = re.fullmatch(MATCH_SPEC, spec)
    bpw, shapes = linears(theirs)
    bpw = math.floor((bpw - MATCH_MARGIN) * 1000) / 1000
    label = f"{found[1]}-bpw{bpw:.3f}" + (f"-{found[2]}" if found[2] else "")
    try:
        check_budget(shapes, bpw, found[2].split("+") if found[2] else None)
    except ConfigError as exc:
        log(f"--match-sizes {spec} at {theirs.name}: skipped, {exc}")
        return None
    add_budget_method(label)
    return label


SAME_TYPES_SHARE = 0.95  # pairs for the decode comparison: at least this share of tensors in the same type


PLAIN = ("F32", "F16", "BF16")


def tensor_types(file: Path) -> dict:
    """Tensor name -> its block type's name (F32, Q4_0, ...)."""
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(file).tensors}


def same_type_pairs(rows: dict, work: Path) -> list[tuple[str, str, float]]:
    """(slmedge's row, llama.cpp's imatrix row, share): each of slmedge's files with its codes kept and the
    llama.cpp imatrix file that stores the most of its tensors in the same block type, where that share is
    at least ``SAME_TYPES_SHARE`` (read from the files: llama.cpp's Q4_0 recipe, for one, raises a few
    ffn_down tensors to Q4_1, and its K-quant "_M" recipes mix in Q6_K, which leaves those unpaired)."""
    theirs = {k: tensor_types(work / r["file"]) for k, r in rows.items() if k.endswith(" llama-imatrix")}
    pairs = []
    for label, r in rows.items():
        if r["producer"] != "slmedge" or not label.endswith("codes kept"):
            continue
        ours = tensor_types(work / r["file"])
        shares = {}
        for k, t in theirs.items():  # over the tensors either file quantizes (norms are F32 in both)
            names = [n for n, ty in ours.items() if ty not in PLAIN or t.get(n) not in PLAIN]
            shares[k] = sum(t.get(n) == ours[n] for n in names) / len(names) if names else 0.0
        best = max(shares, key=shares.get, default=None)
        if best is not None and shares[best] >= SAME_TYPES_SHARE:
            pairs.append((label, best, shares[best]))
    return pairs


def in_turns(a: Path, b: Path, model: str, rounds: int, threads: int, runtime: str | None = None) -> dict:
    """Prefill and decode tokens/s of ``a`` against ``b`` (files or folders), measured in turns (A B A B ...:
    drift of the machine falls on both), ``rounds`` rounds of ``slmedge evaluate --metrics latency`` (pp 128,
    tg 64, 3 repeats) in ``runtime`` (default: each file's own). The GGUF, ONNX and ExecuTorch comparisons
    measure their same-layout pairs with it: {"tps": name -> {"prefill": [...], "decode": [...]},
    "median": name -> {"prefill", "decode"}, "prefill_ratio", "decode_ratio"} (ratios ``a`` / ``b``)."""
    from slmedge.evaluate.api import EvalSettings, evaluate

    settings = EvalSettings(metrics=("latency",), reference=model, runtime=runtime, pp=128, tg=64, repeats=3,
                            threads=threads)
    target = {f: str(f / "model.pte") if (f / "model.pte").is_file() else str(f) for f in (a, b)}
    tps = {f.name: {"prefill": [], "decode": []} for f in (a, b)}
    for _ in range(rounds):
        for f in (a, b):
            lat = evaluate(target[f], settings)["metrics"]["latency"]
            tps[f.name]["prefill"].append(lat["prefill_tps"]["median"])
            tps[f.name]["decode"].append(lat["decode_tps"]["median"])
    med = {k: {m: sorted(v[m])[len(v[m]) // 2] for m in v} for k, v in tps.items()}
    return {"tps": tps, "median": med, "prefill_ratio": med[a.name]["prefill"] / med[b.name]["prefill"],
            "decode_ratio": med[a.name]["decode"] / med[b.name]["decode"]}


def decode_pairs(rows: dict, work: Path, model: str, args) -> dict:
    """Decode tokens/s of slmedge's files against llama.cpp's of the same block types
    (``same_type_pairs``), measured in turns (``in_turns``, ``--decode-rounds`` rounds); the median per
    file and the ratio."""
    pairs = same_type_pairs(rows, work)
    if not pairs:
        return {}
    out = {}
    for ours, theirs, share in pairs:
        a, b = work / rows[ours]["file"], work / rows[theirs]["file"]
        t = in_turns(a, b, model, args.decode_rounds, args.threads)
        tps = {k: v["decode"] for k, v in t["tps"].items()}
        med = {k: v["decode"] for k, v in t["median"].items()}
        out[ours] = {"slmedge": a.name, "llama.cpp": b.name, "same_types": share, "tps": tps, "median": med,
                     "ratio": t["decode_ratio"]}
        log(f"decode {ours} vs {theirs}: {med[a.name]:.1f} vs {med[b.name]:.1f} tok/s "
            f"(ratio {out[ours]['ratio']:.3f}, {args.decode_rounds} rounds in turns)")
    print(f"\n#### {model}: decode tokens/s, same block types, {args.decode_rounds} rounds in turns\n")
    print("| slmedge file | llama.cpp file | tensors in the same type | slmedge tok/s | llama.cpp tok/s | ratio |")
    print("|---|---|---:|---:|---:|---:|")
    for ours, r in out.items():
        print(f"| {ours} | {r['llama.cpp']} | {r['same_types']:.1%} | {r['median'][r['slmedge']]:.1f} | "
              f"{r['median'][r['llama.cpp']]:.1f} | {r['ratio']:.3f} |")
    return out


# Block types that hold every value of a base tensor's type exactly, from the same fp16 scale(s): a
# quantizer writing those can land back on the base's grid. Q4_0 d*(q-8) is Q4_1/Q5_1 with min -8d and
# Q5_0/Q8_0 with the same d; Q4_1 d*q+m is Q5_1 with the same d and m; Q5_0 d*(q-16) is Q5_1 with min
# -16d and Q8_0 with the same d; Q4_K's 256-blocks (d, dmin, 6-bit sub-block scales and mins, 4-bit
# codes) are Q5_K's with the codes' fifth bit clear; Q3_K's signed sub-block scales fit Q6_K's int8 ones.
HOLDS = {"Q4_0": {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}, "Q4_1": {"Q4_1", "Q5_1"}, "Q5_0": {"Q5_0", "Q5_1", "Q8_0"},
         "Q4_K": {"Q4_K", "Q5_K"}, "Q3_K": {"Q3_K", "Q6_K"}}


def on_base_grid(file: Path, model: str) -> float | None:
    """The share of the shipped base GGUF's quantized tensors that ``file`` stores in a block type holding
    the base's exactly (its own, or a wider one: ``HOLDS``; None for a model that is no embedded GGUF):
    where it is high, a row can land back on the grid the base's weights already sit on, and looks
    better than it would on a 16-bit model (the caveat)."""
    from slmedge.models.source import embedded_gguf_path

    try:
        base = tensor_types(embedded_gguf_path(model))
    except Exception:
        return None
    ours = tensor_types(file)
    names = [n for n, t in base.items() if t not in PLAIN and n in ours]
    return sum(ours[n] in HOLDS.get(base[n], {base[n]}) for n in names) / len(names) if names else None


def print_table(model: str, rows: dict) -> None:
    caveat = CAVEAT.get(model)
    print(f"\n### {model}\n")
    print("| file | producer | MB | mean KL | top-1 | perplexity (geo. mean) | decode tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, r in sorted(rows.items(), key=lambda kv: (kv[1]["bytes"], kv[0])):
        share = r.get("on_base_grid")
        mark = f" (caveat: {share:.0%} can hold the base's grid)" if share is not None and share >= 0.5 else ""
        tps = f"{r['decode_tps']:.1f}" if r.get("decode_tps") else "-"
        print(f"| {label}{mark} | {r['producer']} | {r['bytes'] / 1e6:.1f} | {r['mean_kl']:.4f} | {r['top1']:.1%} | "
              f"{r['ppl_geomean']:.2f} | {tps} |")
    if caveat:
        print(f"\nCaveat: {model}'s only weights are a {caveat} GGUF; rows marked store at least half of its "
              f"quantized tensors in a block type that holds the base's type exactly (its own, or a wider one: Q5_1 "
              f"holds Q4_1), so they can land back on its grid.")


def caveat_mark(row: dict) -> str:
    share = row.get("on_base_grid")
    return f" (caveat: {share:.0%})" if share is not None and share >= 0.5 else ""


def goal_rows(rows: dict) -> list[dict]:
    """The benchmark's goal, per llama.cpp imatrix file (smallest first): slmedge's file of equal or smaller
    size that is lower on both mean KL and perplexity (off the caveat first, then the lowest KL), else the
    nearest miss (lower on one of them, then the lowest KL);
    ``verdict``: yes, KL only, perplexity only, no, or none (no slmedge file that small)."""
    scored = {k: r for k, r in rows.items() if r.get("mean_kl") is not None and r.get("ppl_geomean")}
    ours = {k: r for k, r in scored.items() if r["producer"] == "slmedge"}
    out = []
    for label, theirs in sorted(((k, r) for k, r in scored.items() if k.endswith(" llama-imatrix")),
                                key=lambda kv: (kv[1]["bytes"], kv[0])):
        pick, verdict = against(ours, theirs, lambda r: (bool(caveat_mark(r)), r["mean_kl"]))
        out.append({"llama": label, "slmedge": pick, "verdict": verdict})
    return out


def against(ours: dict, theirs: dict, prefer) -> tuple[str | None, str]:
    """Of ``ours`` (label -> row), the file of equal or smaller size than ``theirs`` lower on both mean KL and
    perplexity (the first by ``prefer(row)``), else the nearest miss (lower on one of them, then the lowest KL);
    and the verdict: yes, KL only, perplexity only, no, or none (no file that small)."""
    fit = {k: r for k, r in ours.items() if r["bytes"] <= theirs["bytes"]}
    lost = {k: (r["mean_kl"] >= theirs["mean_kl"]) + (r["ppl_geomean"] >= theirs["ppl_geomean"]) for k, r in fit.items()}
    both = [k for k in fit if not lost[k]]
    pick = (min(both, key=lambda k: (prefer(fit[k]), k)) if both else
            min(fit, key=lambda k: (lost[k], fit[k]["mean_kl"], k)) if fit else None)
    if pick is None:
        return None, "none"
    kl, ppl = fit[pick]["mean_kl"] < theirs["mean_kl"], fit[pick]["ppl_geomean"] < theirs["ppl_geomean"]
    return pick, {(True, True): "yes", (True, False): "KL only", (False, True): "perplexity only", (False, False): "no"}[(kl, ppl)]


def print_goal(model: str, goal: list[dict], rows: dict) -> None:
    print(f"\n#### {model}: each llama.cpp imatrix file against slmedge's file of equal or smaller size\n")
    print("| llama.cpp imatrix file | MB | KL / ppl | slmedge file | MB | KL / ppl | both lower? |")
    print("|---|---:|---|---|---:|---|---|")
    for g in goal:
        t = rows[g["llama"]]
        mine = rows[g["slmedge"]] if g["slmedge"] else None
        ours = (f"{g['slmedge']}{caveat_mark(mine)} | {mine['bytes'] / 1e6:.1f} | {mine['mean_kl']:.4f} / "
                f"{mine['ppl_geomean']:.2f}") if mine else "- | - | -"
        print(f"| {g['llama']}{caveat_mark(t)} | {t['bytes'] / 1e6:.1f} | {t['mean_kl']:.4f} / {t['ppl_geomean']:.2f} | "
              f"{ours} | {g['verdict']} |")
    won = sum(g["verdict"] == "yes" for g in goal)
    print(f"\nThe goal (a slmedge file of equal or smaller size lower on both) holds at {won} of {len(goal)} sizes.")


if __name__ == "__main__":
    sys.exit(main())
