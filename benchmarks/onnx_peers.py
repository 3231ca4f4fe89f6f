#!/usr/bin/env python
"""Benchmark: slmedge's ONNX files against what onnxruntime's own int4 tools make from the same base.

What an onnxruntime user gets for free, measured side by side with what slmedge writes, per model:

1. The base: ``slmedge export MODEL --format onnx --type fp32`` (the fp32 graph of the model slmedge
   loads, with its config and tokenizer), and the Hugging Face folder slmedge materializes from it (the
   embedded GGUF's conversion) for onnxruntime-genai's builder.
2. onnxruntime's ``MatMulNBitsQuantizer`` on that fp32 graph, each algorithm (``--algos``: RTN, k-quant,
   HQQ, GPTQ; asymmetric, accuracy level 4, as a user calls it) at each block size (``--blocks``, 32 and
   128). GPTQ reads the calibration windows ``slmedge compress`` samples (``--calibration``, slmedge's
   default unless given; ``--nsamples`` x ``--seqlen`` tokens, seed 0). A peer that fails (RTN at block
   128 on 576-wide rows, for one) is a row saying why.
3. onnxruntime-genai's model builder (``python -m onnxruntime_genai.models.builder -p int4 -e cpu
   --extra_options int4_block_size=B int4_algo_config=A``) from the Hugging Face folder, each
   ``--builder-algos`` (rtn, k_quant, k_quant_last, k_quant_mixed) at each block size.
4. slmedge's files (``--methods``): a calibrated method's artifact on the same windows, exported with
   its codes kept (``slmedge export --format onnx --exact``, with the export options the label names);
   ``gptq-bpw5.03-t4`` is GPTQ to a size budget over MatMulNBits layouts (``compress --bpw 5.03
   --bpw-grids onnx``: 4- and 8-bit, blocks 32 to 128, per linear) at the builder's file size. A label
   ending ``-a0`` is the same file at MatMulNBits accuracy level 0 (fp32 activations; the export's default
   is 4, int8 activations); one ending ``-genai`` is the onnxruntime-genai folder (``--format
   onnxruntime-genai``: the same model.onnx and genai_config.json), scored in onnxruntime-genai.
5. Every file scored by ``slmedge evaluate`` in onnxruntime (the builder's folders in onnxruntime-genai, on
   onnxruntime: slmedge's own loop feeds a KV cache their GroupQueryAttention refuses): mean KL and top-1
   against the base model in torch (``--fidelity-windows`` x 512 WikiText-2 tokens), perplexity in the shipped languages and
   WikiText-2 (``--ppl-windows`` windows each; the geometric mean), and with ``--latency`` prefill and
   decode tokens/s (128 + 32 tokens, 2 repeats).

The table (sizes on disk: the model file plus its external data) is printed and written with every
number to ``WORK/MODEL/results.json``, and after it the goal: for each peer file, slmedge's smallest
file of equal or smaller size that is lower on both mean KL and perplexity (or the nearest miss).
With ``--latency``, each slmedge file's prefill and decode tokens/s against the peer of its layout in the
same runtime, ``--speed-rounds`` rounds in turns (A B A B ...: drift of the machine falls on both), the
medians and their ratio against the goal's 0.95: an ONNX file of one block size against onnxruntime's RTN
file at that block (the same MatMulNBits kernels on the same graph), a budget's mixed layouts against block
32's, a ``-genai`` folder against the builder's folder in onnxruntime-genai, an ``-a0`` file against itself
at accuracy level 4.
Caveat: the embedded models' only weights are a Q4_1 GGUF (SmolLM2, block 32) and a Q4_K_M one
(Gemma 3): a quantizer with a float zero point at block 32 (HQQ) finds SmolLM2's grid again and looks
nearly lossless; it would not on a 16-bit model. Such rows are marked.

Runs one step after another (never two timed things at once). Resumable: a file or score already in
WORK is reused while its inputs are unchanged (each step's inputs are in a ``.inputs.json`` beside it;
everything counts slmedge's own source among them).

    .venv/bin/python benchmarks/onnx_peers.py                              # both embedded models, all rows
    .venv/bin/python benchmarks/onnx_peers.py --models smollm2-135m --nsamples 16 --ppl-windows 1
    .venv/bin/python benchmarks/onnx_peers.py --algos rtn hqq --blocks 32 --builder-algos rtn --methods awq-g32
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.gguf_peers import against, fresh, in_turns, log, scored, stamp  # noqa: E402 - the GGUF comparison's steps and goal

ALGOS = ("rtn", "k_quant", "hqq", "gptq")
BUILDER_ALGOS = ("rtn", "k_quant", "k_quant_last", "k_quant_mixed")
BLOCKS = (32, 128)
# slmedge's artifacts (compress options) and the files exported from them (label -> artifact, export options).
ARTIFACTS = {
    "awq-g32": ["--method", "awq", "--bits", "4", "--group-size", "32", "--asym"],
    "gptq-g32": ["--method", "gptq", "--bits", "4", "--group-size", "32", "--asym"],
    "awq-g128": ["--method", "awq", "--bits", "4", "--group-size", "128", "--asym"],
    "gptq-g128": ["--method", "gptq", "--bits", "4", "--group-size", "128", "--asym"],
    "rtn-g32": ["--method", "rtn", "--bits", "4", "--group-size", "32", "--asym"],
    "rtn-g32-sym": ["--method", "rtn", "--bits", "4", "--group-size", "32", "--sym"],
    "gptq-g32-sym": ["--method", "gptq", "--bits", "4", "--group-size", "32", "--sym"],
    # A size budget over MatMulNBits layouts (4- and 8-bit, blocks 32/64/128, the ``onnx`` set), each linear's
    # layout by its measured error weighted by its reach into the residual stream. 5.03 bits per weight of
    # the linears puts SmolLM2-135M's -t4 file just under the builder's 86.5 MB (its int4 embedding and the
    # rest are ~19.5 MB: gptq-g32-t4, 5.125 bits per weight, is 87.5 MB).
    "gptq-bpw5.03": ["--method", "gptq", "--bpw", "5.03", "--bpw-grids", "onnx"],
}
TABLES = {"": [],  # the export's defaults: fp16 embedding, 8-bit head
          "-t8": ["--embedding-type", "int8", "--head-type", "int8"],  # 8-bit embedding and head (one copy if tied)
          "-t4": ["--embedding-type", "int4", "--head-type", "int4"],  # 4-bit, block 32
          "-t4b64": ["--embedding-type", "int4", "--head-type", "int4", "--block-size", "64"]}
# The format and runtime options of each file: the ONNX folder in onnxruntime (accuracy level 4, the export's
# default: int8 activations), the same at accuracy level 0 (fp32 activations), and the onnxruntime-genai folder
# (the same model.onnx with genai_config.json, run by onnxruntime-genai as the builder's folders are).
VARIANTS = {"": ("onnx", []), "-a0": ("onnx", ["--accuracy-level", "0"]), "-genai": ("onnxruntime-genai", [])}
METHODS = {f"{art}{suffix}{variant}": (art, opts + vopts, fmt) for art in ARTIFACTS for suffix, opts in TABLES.items()
           for variant, (fmt, vopts) in VARIANTS.items()}
DEFAULT_METHODS = ("awq-g32", "awq-g32-t8", "awq-g32-t4", "gptq-g32-t4", "awq-g128-t4b64", "gptq-g128-t4b64")
# The base's own grid, where a peer's float zero point at that block size can land back on it.
CAVEAT = {"smollm2-135m": ("Q4_1", 32), "gemma3-270m": ("Q4_K_M", None)}
MODEL_FILES = ("model.onnx", "model.onnx.data", "model.onnx_data")
BESIDE = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def run(cmd: list, what: str, log_file: Path) -> None:
    log(f"{what}: {' '.join(str(c) for c in cmd)}")
    started = time.perf_counter()
    with open(log_file, "w") as out:
        rc = subprocess.run([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise StepFailed(f"{what} failed (exit {rc}); see {log_file}")
    log(f"{what}: {time.perf_counter() - started:.1f} s")


class StepFailed(Exception):
    """A peer or slmedge step that did not make its file: a row saying why."""


def slmedge(*args) -> list:
    return [sys.executable, "-m", "slmedge", *map(str, args)]


CODE = ""  # slmedge's source digest (main sets it): part of the inputs of every step


def folder_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in MODEL_FILES:
        if (folder / name).is_file():
            with open(folder / name, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()[:16]


def model_bytes(folder: Path) -> int:
    """The model on disk: its .onnx file and its external data."""
    return sum((folder / n).stat().st_size for n in MODEL_FILES if (folder / n).is_file())


def missing_tools(need_builder: bool) -> str | None:
    """Why a peer tool cannot run here (None: all there)."""
    if importlib.util.find_spec("onnxruntime") is None:
        return "onnxruntime is not installed (pip install onnxruntime)"
    try:
        from onnxruntime.quantization import matmul_nbits_quantizer as q

        for name in ("RTNWeightOnlyQuantConfig", "KQuantWeightOnlyQuantConfig", "HQQWeightOnlyQuantConfig",
                     "GPTQWeightOnlyQuantConfig", "MatMulNBitsQuantizer"):
            getattr(q, name)
    except (ImportError, AttributeError) as exc:
        return f"onnxruntime's MatMulNBits quantizer is not usable here ({exc})"
    if need_builder and importlib.util.find_spec("onnxruntime_genai") is None:
        return "onnxruntime-genai is not installed (pip install 'slmedge[genai]'), its model builder is a peer"
    return None


# --- peers ------------------------------------------------------------------------------------


class CalibrationReader:
    """onnxruntime's CalibrationDataReader over slmedge's calibration windows: each window a prefill with
    an empty KV cache, the inputs the graph declares."""

    def __init__(self, graph_file: Path, windows: list[list[int]]):
        import numpy as np
        import onnx

        graph = onnx.load(str(graph_file), load_external_data=False)
        self.feeds = []
        for ids in windows:
            n = len(ids)
            feed = {}
            for i in graph.graph.input:
                dims = [d.dim_value for d in i.type.tensor_type.shape.dim]
                if i.name == "input_ids":
                    feed[i.name] = np.asarray([ids], dtype=np.int64)
                elif i.name == "attention_mask":
                    feed[i.name] = np.ones((1, n), dtype=np.int64)
                elif i.name == "position_ids":
                    feed[i.name] = np.arange(n, dtype=np.int64)[None]
                elif i.name.startswith("past_key_values."):
                    feed[i.name] = np.zeros((1, dims[1], 0, dims[3]), dtype=np.float32)
            self.feeds.append(feed)
        self.it = iter(self.feeds)

    def get_next(self):
        return next(self.it, None)

    def rewind(self):
        self.it = iter(self.feeds)

    def __deepcopy__(self, memo):
        twin = CalibrationReader.__new__(CalibrationReader)
        twin.feeds = self.feeds
        twin.it = iter(self.feeds)
        return twin

    def __iter__(self):
        return iter(self.feeds)


def ort_peer(base: Path, out: Path, algo: str, block: int, windows: list[list[int]]) -> None:
    """``MatMulNBitsQuantizer`` with ``algo`` at ``block`` (asymmetric, accuracy level 4) on the fp32 base,
    written to ``out`` with the base's config and tokenizer."""
    import logging
    import warnings

    import onnx
    from onnxruntime.quantization import matmul_nbits_quantizer as q

    config = {"rtn": lambda: q.RTNWeightOnlyQuantConfig(),
              "k_quant": lambda: q.KQuantWeightOnlyQuantConfig(),
              "hqq": lambda: q.HQQWeightOnlyQuantConfig(block_size=block, bits=4),
              "gptq": lambda: q.GPTQWeightOnlyQuantConfig(calibration_data_reader=CalibrationReader(base / "model.onnx",
                                                                                                   windows))}[algo]()
    model = onnx.load(str(base / "model.onnx"), load_external_data=True)
    quant = q.MatMulNBitsQuantizer(model, bits=4, block_size=block, is_symmetric=False, accuracy_level=4,
                                   algo_config=config)
    root = logging.getLogger()
    level, root.level = root.level, logging.WARNING
    try:
        with warnings.catch_warnings(), open(os.devnull, "w") as quiet, \
                contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):  # its per-node progress lines
            warnings.simplefilter("ignore")
            quant.process()
    except Exception as exc:  # noqa: BLE001 - onnxruntime's quantizers raise anything; the row says what
        raise StepFailed(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]) from None
    finally:
        root.setLevel(level)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    onnx.save_model(quant.model.model, str(tmp / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=1024)
    for name in BESIDE:
        if (base / name).is_file():
            shutil.copyfile(base / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def builder_peer(hf_dir: Path, out: Path, algo: str, block: int, work: Path) -> None:
    """onnxruntime-genai's model builder, int4 for the CPU, from the Hugging Face folder; the config.json
    copied beside its files (slmedge evaluate reads the model's shape from it)."""
    tmp = out.with_name(out.name + ".tmp")
    cache = out.with_name(out.name + ".cache")
    shutil.rmtree(tmp, ignore_errors=True)
    run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf_dir, "-o", tmp, "-p", "int4", "-e", "cpu",
         "-c", cache, "--extra_options", f"int4_block_size={block}", f"int4_algo_config={algo}"],
        f"builder {algo} block {block}", work / "logs" / f"{out.name}.log")
    shutil.rmtree(cache, ignore_errors=True)
    for name in ("config.json", "generation_config.json"):
        if (hf_dir / name).is_file() and not (tmp / name).is_file():
            shutil.copyfile(hf_dir / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


# --- scores -----------------------------------------------------------------------------------


def score(folder: Path, model: str, args) -> dict:
    # The builder's folder runs in onnxruntime-genai (onnxruntime underneath): slmedge's own onnxruntime loop
    # feeds a KV cache the builder's GroupQueryAttention nodes refuse.
    runtime = "onnxruntime-genai" if (folder / "genai_config.json").is_file() else "onnxruntime"
    return scored(folder, folder.with_name(folder.name + ".score.json"), folder_digest(folder), model_bytes(folder),
                  model, args, runtime=runtime)


# --- the run ----------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--algos", nargs="+", default=list(ALGOS), help=f"onnxruntime's quantizers: {', '.join(ALGOS)} or none")
    ap.add_argument("--blocks", nargs="+", type=int, default=list(BLOCKS), help="block sizes of the peers (32 128)")
    ap.add_argument("--builder-algos", nargs="+", default=list(BUILDER_ALGOS),
                    help=f"onnxruntime-genai builder's int4_algo_config: {', '.join(BUILDER_ALGOS)} or none")
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), help=f"slmedge's files: {', '.join(METHODS)} or none")
    ap.add_argument("--calibration", default=None, help="calibration spec for GPTQ's peer and slmedge (default: slmedge's)")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--gptq-windows", type=int, default=None, help="GPTQ's peer reads the first N of the calibration "
                    "windows (default: all; onnxruntime's GPTQ runs the whole model once per linear input and window)")
    ap.add_argument("--ppl-windows", type=int, default=4)
    ap.add_argument("--fidelity-windows", type=int, default=4)
    ap.add_argument("--latency", action="store_true", help="also prefill and decode tokens/s in onnxruntime (128 + 32 tokens)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--speed-rounds", type=int, default=3, help="rounds of the same-layout speed comparison (--latency)")
    ap.add_argument("--work", type=Path, default=ROOT / ".bench" / "onnx")
    args = ap.parse_args()
    algos = [a for a in args.algos if a != "none"]
    builder = [a for a in args.builder_algos if a != "none"]
    methods = [m for m in args.methods if m != "none"]
    for flag, given, known in (("--algos", algos, ALGOS), ("--builder-algos", builder, BUILDER_ALGOS),
                               ("--methods", methods, tuple(METHODS))):
        unknown = [a for a in given if a not in known]
        if unknown:
            print(f"error: {flag}: unknown {unknown[0]}; choose from {', '.join(known)} or none", file=sys.stderr)
            return 2
    bad = [b for b in args.blocks if b < 16 or b & (b - 1)]
    if bad:
        print(f"error: --blocks: {bad[0]} is not a power of two >= 16 (MatMulNBits' block sizes)", file=sys.stderr)
        return 2
    why = missing_tools(bool(builder))
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    from slmedge.compress.recipe import Recipe
    from slmedge.data.calibration import calibration_sources
    from slmedge.errors import DataError
    from slmedge.study.inputs import slmedge_digest

    global CODE
    CODE = slmedge_digest()
    args.calibration = args.calibration or Recipe.calibration
    try:
        calibration_sources(args.calibration)
    except DataError as exc:
        print(f"error: --calibration: {exc}", file=sys.stderr)
        return 2
    for model in args.models:
        work = args.work / model
        (work / "logs").mkdir(parents=True, exist_ok=True)
        rows = make_and_score(model, work, algos, builder, methods, args)
        print_table(model, rows)
        goal = goal_rows(rows)
        print_goal(model, goal, rows)
        speeds = speed_pairs(rows, work, model, args) if args.latency else {}
        print_speeds(model, speeds, args.speed_rounds)
        (work / "results.json").write_text(json.dumps({"model": model, "args": {k: str(v) for k, v in vars(args).items()},
                                                       "rows": rows, "goal": goal, "speed_pairs": speeds}, indent=2))
    return 0


def make_and_score(model: str, work: Path, algos: list, builder: list, methods: list, args) -> dict:
    """Every file of ``model`` made (or reused) and scored: row label -> its numbers, or its failure."""
    from slmedge.data.calibration import load_calibration
    from slmedge.models.source import embedded_gguf_path, gguf_to_hf_dir, load

    files: dict[str, tuple[str, Path | str, dict]] = {}  # label -> (producer, folder or failure, layout)
    base = work / "base-fp32"
    if not fresh(base, {"model": model, "slmedge": CODE}):
        run(slmedge("export", model, "--format", "onnx", "--type", "fp32", "-o", base, "--overwrite"),
            "base fp32 ONNX", work / "logs" / "base.log")
        stamp(base, {"model": model, "slmedge": CODE})
    windows = None
    for algo in algos:
        for block in args.blocks:
            out = work / f"ort-{algo}-b{block}"
            inputs = {"base": folder_digest(base), "algo": algo, "block": block, "slmedge": CODE}
            if algo == "gptq":
                inputs.update(calibration=args.calibration, nsamples=args.nsamples, seqlen=args.seqlen,
                              windows=args.gptq_windows)
            label = f"onnxruntime {algo}, block {block}"
            failed = out.with_name(out.name + ".failed")
            if not fresh(out, inputs):
                if fresh(failed, inputs):
                    files[label] = ("onnxruntime", failed.read_text(), {"block": block, "algo": algo})
                    continue
                if algo == "gptq" and windows is None:
                    loaded = load(model)
                    windows = load_calibration(args.calibration, loaded.tokenizer, args.nsamples, args.seqlen, 0).tokens.tolist()
                    del loaded
                log(f"onnxruntime {algo} block {block}")
                started = time.perf_counter()
                try:
                    ort_peer(base, out, algo, block, (windows or [])[:args.gptq_windows])
                except StepFailed as exc:
                    log(f"onnxruntime {algo} block {block}: failed: {exc}")
                    failed.write_text(str(exc))
                    stamp(failed, inputs)
                    files[label] = ("onnxruntime", str(exc), {"block": block, "algo": algo})
                    continue
                log(f"onnxruntime {algo} block {block}: {time.perf_counter() - started:.1f} s")
                stamp(out, inputs)
            files[label] = ("onnxruntime", out, {"block": block, "algo": algo})
    if builder:
        gguf = embedded_gguf_path(model)
        hf_dir = gguf_to_hf_dir(gguf)
        import onnxruntime_genai

        for algo in builder:
            for block in args.blocks:
                out = work / f"builder-{algo}-b{block}"
                inputs = {"gguf": gguf.name, "algo": algo, "block": block, "genai": onnxruntime_genai.__version__,
                          "slmedge": CODE}
                label = f"builder {algo}, block {block}"
                if not fresh(out, inputs):
                    try:
                        builder_peer(hf_dir, out, algo, block, work)
                    except StepFailed as exc:
                        files[label] = ("onnxruntime-genai", str(exc), {"block": block, "algo": algo})
                        continue
                    stamp(out, inputs)
                files[label] = ("onnxruntime-genai", out, {"block": block, "algo": algo})
    for label in methods:
        art_label, export_opts, fmt = METHODS[label]
        out = work / f"slmedge-{label}"
        inputs = {"model": model, "compress": ARTIFACTS[art_label], "export": [fmt, *export_opts],
                  "calibration": args.calibration, "nsamples": args.nsamples, "seqlen": args.seqlen, "slmedge": CODE}
        opts = ARTIFACTS[art_label]
        block = int(opts[opts.index("--group-size") + 1]) if "--group-size" in opts else None  # a budget: mixed
        layout = {"block": block, "method": label}
        if not fresh(out, inputs):
            art = work / f"artifact-{art_label}"
            art_inputs = {k: v for k, v in inputs.items() if k != "export"}
            step_log = work / "logs" / f"compress-{art_label}.log"
            try:
                if not fresh(art, art_inputs):
                    run(slmedge("compress", model, *ARTIFACTS[art_label], "--calibration", args.calibration,
                                "--nsamples", args.nsamples, "--seqlen", args.seqlen, "-o", art, "--overwrite"),
                        f"compress {art_label}", step_log)
                    stamp(art, art_inputs)
                step_log = work / "logs" / f"export-{label}.log"
                run(slmedge("export", art, "--format", fmt, "--exact", *export_opts, "-o", out, "--overwrite"),
                    f"export {label}", step_log)
            except StepFailed as exc:  # a row saying why (the step's last line), the rest of the table goes on
                lines = step_log.read_text().strip().splitlines() if step_log.is_file() else []
                files[f"slmedge {label}, codes kept"] = ("slmedge", (lines[-1] if lines else str(exc))[:200], layout)
                continue
            stamp(out, inputs)
        files[f"slmedge {label}, codes kept"] = ("slmedge", out, layout)
    rows = {}
    for label, (producer, where, layout) in files.items():
        if isinstance(where, str):
            rows[label] = {"producer": producer, "failed": where, **layout}
            continue
        rows[label] = {"producer": producer, "file": where.name, **layout, **score(where, model, args)}
        rows[label]["caveat"] = on_base_grid(model, rows[label])
    return rows


def on_base_grid(model: str, row: dict) -> bool:
    """A peer with a float zero point (HQQ) at the block size of the base's own grid (SmolLM2's Q4_1 at
    block 32: a float min per 32 weights) can land back on the grid the base's weights already sit on."""
    grid = CAVEAT.get(model)
    return bool(grid and grid[1] and row.get("algo") == "hqq" and row.get("block") == grid[1])


def print_table(model: str, rows: dict) -> None:
    print(f"\n### {model}\n")
    print("| file | producer | MB | mean KL | top-1 | perplexity (geo. mean) | prefill tok/s | decode tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    done = sorted(((k, r) for k, r in rows.items() if "failed" not in r), key=lambda kv: (kv[1]["bytes"], kv[0]))
    for label, r in done:
        mark = " (caveat)" if r.get("caveat") else ""
        tps = [f"{r[k]:.1f}" if r.get(k) else "-" for k in ("prefill_tps", "decode_tps")]
        print(f"| {label}{mark} | {r['producer']} | {r['bytes'] / 1e6:.1f} | {r['mean_kl']:.4f} | {r['top1']:.1%} | "
              f"{r['ppl_geomean']:.2f} | {tps[0]} | {tps[1]} |")
    for label, r in rows.items():
        if "failed" in r:
            print(f"| {label} | {r['producer']} | failed: {r['failed']} | | | | | |")
    grid = CAVEAT.get(model)
    if grid:
        print(f"\nCaveat: {model}'s only weights are a {grid[0]} GGUF; rows marked (a float zero point at the base's "
              f"own block size) can land back on its grid and look better than they would on a 16-bit model.")


def goal_rows(rows: dict) -> list[dict]:
    """Per peer file (smallest first): slmedge's smallest file of equal or smaller size lower on both mean KL
    and perplexity, else the nearest miss (lower on one, then the lowest KL); ``verdict``: yes, KL only,
    perplexity only, no, or none (no slmedge file that small)."""
    scored = {k: r for k, r in rows.items() if r.get("mean_kl") is not None and r.get("ppl_geomean")}
    ours = {k: r for k, r in scored.items() if r["producer"] == "slmedge"}
    out = []
    for label, theirs in sorted(((k, r) for k, r in scored.items() if r["producer"] != "slmedge"),
                                key=lambda kv: (kv[1]["bytes"], kv[0])):
        pick, verdict = against(ours, theirs, lambda r: r["bytes"])
        row = {"peer": label, "slmedge": pick, "verdict": verdict}
        if pick is None and ours:  # nothing that small: the nearest miss is slmedge's smallest file
            row["nearest"] = min(ours, key=lambda k: (ours[k]["bytes"], k))
        out.append(row)
    return out


SPEED_GOAL = 0.95  # the floor: prefill and decode at least 0.95 of the same layout's peer


def speed_peer(label: str, row: dict, rows: dict) -> tuple[str | None, str]:
    """The peer file of ``row``'s layout, in the runtime it runs in, and what makes it that peer:
    - an onnxruntime-genai folder: the builder's folder at its block size (else the builder's block 32),
      both run by onnxruntime-genai;
    - accuracy level 0: the same slmedge file at level 4 (what the level costs or buys);
    - an ONNX file of one block size: onnxruntime's RTN (else k-quant) file at that block size, the same
      MatMulNBits kernels on the same graph;
    - a budget's mixed layouts: onnxruntime's RTN (else k-quant) at block 32, the nearest single layout."""
    ok = lambda k: k in rows and "failed" not in rows[k]  # noqa: E731
    block = row.get("block")
    method = row.get("method") or ""
    if method.endswith("-genai"):
        for b in (block, 32):
            for algo in BUILDER_ALGOS:
                if ok(f"builder {algo}, block {b}"):
                    return f"builder {algo}, block {b}", "same runtime (onnxruntime-genai), the builder's graph"
        return None, ""
    if method.endswith("-a0"):
        same = f"slmedge {method[:-3]}, codes kept"
        return (same, "the same file at accuracy level 4") if ok(same) else (None, "")
    for b, why in ((block, f"MatMulNBits block {block}"), (32, "mixed layouts; nearest single layout: block 32")):
        if b is None:
            continue
        for algo in ALGOS:
            if ok(f"onnxruntime {algo}, block {b}"):
                return f"onnxruntime {algo}, block {b}", why
    return None, ""


def speed_pairs(rows: dict, work: Path, model: str, args) -> dict:
    """Prefill and decode tokens/s of each slmedge file against the peer of its layout (``speed_peer``) in
    the same run, ``--speed-rounds`` rounds in turns (``in_turns``); the medians and the ratios
    (slmedge / peer)."""
    out = {}
    for label, r in rows.items():
        if r["producer"] != "slmedge" or "failed" in r:
            continue
        peer, why = speed_peer(label, r, rows)
        if peer is None:
            continue
        runtime = "onnxruntime-genai" if (work / r["file"] / "genai_config.json").is_file() else "onnxruntime"
        out[label] = {"peer": peer, "pairing": why, **in_turns(work / r["file"], work / rows[peer]["file"], model,
                                                               args.speed_rounds, args.threads, runtime=runtime)}
        log(f"speed {label} vs {peer}: prefill ratio {out[label]['prefill_ratio']:.3f}, decode ratio "
            f"{out[label]['decode_ratio']:.3f} ({args.speed_rounds} rounds in turns)")
    return out


def print_speeds(model: str, speeds: dict, rounds: int) -> None:
    if not speeds:
        return
    print(f"\n#### {model}: tokens/s against the peer of the same layout, {rounds} rounds in turns (medians)\n")
    print(f"| slmedge file | peer file | pairing | prefill tok/s | peer | ratio | decode tok/s | peer | ratio | ≥ {SPEED_GOAL}? |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    won = judged = 0
    for label, s in speeds.items():
        a, b = list(s["median"])  # slmedge's file first
        ok = s["prefill_ratio"] >= SPEED_GOAL and s["decode_ratio"] >= SPEED_GOAL
        peer_is_a_peer = not s["peer"].startswith("slmedge ")  # accuracy level 0 against level 4: no goal
        won, judged = won + (ok and peer_is_a_peer), judged + peer_is_a_peer
        print(f"| {label} | {s['peer']} | {s['pairing']} | {s['median'][a]['prefill']:.1f} | "
              f"{s['median'][b]['prefill']:.1f} | {s['prefill_ratio']:.3f} | {s['median'][a]['decode']:.1f} | "
              f"{s['median'][b]['decode']:.1f} | {s['decode_ratio']:.3f} | "
              f"{('yes' if ok else 'no') if peer_is_a_peer else '-'} |")
    print(f"\nSpeed goal (prefill and decode ≥ {SPEED_GOAL} of the peer): holds for {won} of {judged} pairs.")


def print_goal(model: str, goal: list[dict], rows: dict) -> None:
    print(f"\n#### {model}: each peer file against slmedge's smallest file of equal or smaller size lower on both\n")
    print("| peer file | MB | KL / ppl | slmedge file | MB | KL / ppl | both lower? |")
    print("|---|---:|---|---|---:|---|---|")
    for g in goal:
        t = rows[g["peer"]]
        name = g["slmedge"] or g.get("nearest")
        mine = rows[name] if name else None
        ours = (f"{name}{'' if g['slmedge'] else ' (larger)'} | {mine['bytes'] / 1e6:.1f} | {mine['mean_kl']:.4f} / "
                f"{mine['ppl_geomean']:.2f}") if mine else "- | - | -"
        print(f"| {g['peer']}{' (caveat)' if t.get('caveat') else ''} | {t['bytes'] / 1e6:.1f} | "
              f"{t['mean_kl']:.4f} / {t['ppl_geomean']:.2f} | {ours} | {g['verdict']} |")
    won = sum(g["verdict"] == "yes" for g in goal)
    print(f"\nThe goal (a slmedge file of equal or smaller size lower on both) holds at {won} of {len(goal)} peer files.")


if __name__ == "__main__":
    sys.exit(main())
