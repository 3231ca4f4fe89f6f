#!/usr/bin/env python
"""Benchmark: slmedge's ExecuTorch programs against what torchao makes for an ExecuTorch user from the same base.

What an ExecuTorch user gets for free, measured side by side with what slmedge writes, per model:

1. The base: the Hugging Face folder slmedge loads the model from (the embedded GGUF's conversion).
2. torchao's schemes on it (``--peers``): ``8da4w`` (``Int8DynamicActivationIntxWeightConfig``, int4
   symmetric weights, int8 dynamic activations) and ``4w`` (``IntxWeightOnlyConfig``, int4 weight-only),
   each at each ``--blocks`` group size, on every decoder linear (the head and embedding stay fp32, as
   in slmedge's export), then lowered the way slmedge's export lowers its own: transformers'
   ``TorchExportableModuleForDecoderOnlyLM`` (a static KV cache of the model's positions, at most 2048)
   under ``torch.export``, ``to_edge_transform_and_lower(..., partitioner=[XnnpackPartitioner()])``,
   ``.to_executorch()`` (``slmedge.export.executorch._lower``): the rows differ in their weights only.
   The model's config and tokenizer go beside ``model.pte``. A peer that cannot be made is a row saying
   why: a group that does not divide a linear's inputs (XNNPACK's group-wise kernels need it: SmolLM2's
   576-wide rows at 128), and a scheme whose lowering disagrees with torch on one linear (checked in
   seconds before the whole model: ``lowering_check``; executorch 1.5.1 loses the weight-only ``4w``).
3. slmedge's programs (``--methods``): a calibrated method's artifact on the calibration windows
   ``slmedge compress`` samples (``--calibration``, slmedge's default unless given; ``--nsamples`` x
   ``--seqlen`` tokens, seed 0), exported with its codes kept (``slmedge export --format executorch``).
4. Every program scored by ``slmedge evaluate`` in ExecuTorch's Python runtime: mean KL and top-1 against
   the base model in torch (``--fidelity-windows`` x 512 WikiText-2 tokens), perplexity in the shipped
   languages and WikiText-2 (``--ppl-windows`` windows each; the geometric mean), and with ``--latency``
   prefill and decode tokens/s (128 + 32 tokens, 2 repeats).
5. With ``--latency``: each slmedge program against the peer of the same layout (torchao's 8da4w at the
   same group size: the same XNNPACK kernel), measured in turns over ``--speed-rounds`` rounds (A B A B
   ...: drift of the machine falls on both); the medians and their ratio (slmedge / peer).

The table (``model.pte``'s size on disk) is printed and written with every number to
``WORK/MODEL/results.json``, and after it the goal: for each peer program, slmedge's program of equal or
smaller size that is better on both mean KL and perplexity (or the nearest miss), and the speed ratios
against the goal's 0.95. Caveat: the embedded models' only weights are a Q4_1 GGUF (SmolLM2, block 32) and
a Q4_K_M one (Gemma 3); a layout that holds the base's grid exactly (a float zero point per block of the
base's size) could find it again and look nearly lossless. No row is marked: XNNPACK's int4 kernels are
symmetric and slmedge's asymmetric codes have integer zero points, so none of the layouts here holds it.

Runs one step after another (never two timed things at once). Resumable: a program or score already in
WORK is reused while its inputs are unchanged (each step's inputs are in a ``.inputs.json`` beside it;
everything counts slmedge's own source among them).

    .venv/bin/python benchmarks/executorch_peers.py                        # both embedded models, all rows
    .venv/bin/python benchmarks/executorch_peers.py --models smollm2-135m --nsamples 16 --ppl-windows 1 --latency
    .venv/bin/python benchmarks/executorch_peers.py --peers 8da4w --blocks 32 --methods gptq-sym awq-sym gptq-asym
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.gguf_peers import against, fresh as fresh_exact, in_turns, log, scored, stamp  # noqa: E402 - the GGUF comparison's steps and goal

PEERS = ("8da4w", "4w")
BLOCKS = (32, 128)
# slmedge's artifacts: label -> compress options; each made at every --blocks group size its linears allow.
METHODS = {
    "gptq-sym": ["--method", "gptq", "--bits", "4", "--sym"],
    "awq-sym": ["--method", "awq", "--bits", "4", "--sym"],
    "gptq-asym": ["--method", "gptq", "--bits", "4", "--asym"],
    "awq-asym": ["--method", "awq", "--bits", "4", "--asym"],
}
DEFAULT_METHODS = ("gptq-sym", "awq-sym")
# The base's own grid and its block (a layout with a float zero point per block of that size holds it exactly).
CAVEAT = {"smollm2-135m": ("Q4_1", 32), "gemma3-270m": ("Q4_K_M", None)}
BESIDE = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "chat_template.jinja")
SPEED_GOAL = 0.95


class StepFailed(Exception):
    """A peer or slmedge step that did not make its program: a row saying why."""


def run(cmd: list, what: str, log_file: Path) -> float:
    log(f"{what}: {' '.join(str(c) for c in cmd)}")
    started = time.perf_counter()
    with open(log_file, "w") as out:
        rc = subprocess.run([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        last = [ln for ln in log_file.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise StepFailed(f"{what} failed (exit {rc}): {last[0][:200]}")
    took = time.perf_counter() - started
    log(f"{what}: {took:.1f} s")
    return took


def slmedge(*args) -> list:
    return [sys.executable, "-m", "slmedge", *map(str, args)]


CODE = ""  # slmedge's source digest (main sets it): part of the inputs of every step
KEEP_MADE = False  # --keep-made: a step made by another slmedge source is reused (its row names that source)


def fresh(out: Path, inputs: dict) -> bool:
    """``out`` was made from ``inputs`` (with ``--keep-made``, from the same inputs but any slmedge source)."""
    if fresh_exact(out, inputs):
        return True
    stamp_file = out.with_name(out.name + ".inputs.json")
    if not (KEEP_MADE and out.exists() and stamp_file.is_file()):
        return False
    made = json.loads(stamp_file.read_text())
    return {k: v for k, v in made.items() if k != "slmedge"} == {k: v for k, v in inputs.items() if k != "slmedge"}


def made_by(out: Path) -> str | None:
    """The slmedge source digest ``out`` was made (or scored) with, from its inputs."""
    stamp_file = out.with_name(out.name + ".inputs.json")
    return json.loads(stamp_file.read_text()).get("slmedge") if stamp_file.is_file() else None


def program_digest(folder: Path) -> str:
    h = hashlib.sha256()
    with open(folder / "model.pte", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


# --- peers ------------------------------------------------------------------------------------


def torchao_config(peer: str, group: int):
    """torchao's config for ``peer`` at ``group`` (what an ExecuTorch user passes to ``quantize_``)."""
    import torch
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup

    if peer == "8da4w":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group))
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group))


def linear_inputs(hf_dir: Path) -> set[int]:
    """The input widths of the decoder's linears (what a group must divide)."""
    from slmedge.export.source import weight_shapes

    return {shape[1] for name, shape in weight_shapes(hf_dir) if name.endswith("proj.weight") and len(shape) == 2}


def lowering_check(peer: str, group: int, width: int) -> str | None:
    """One ``Linear(width, 64)`` quantized by torchao's ``peer`` at ``group``, lowered to XNNPACK and run in
    ExecuTorch, against the same quantized linear in eager torch: why the scheme does not survive lowering
    (None: it does, within 5% of the output's scale)."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(width, 64, bias=False)).eval()
    quantize_(lin, torchao_config(peer, group))
    x = torch.randn(4, width)
    with torch.no_grad():
        want = lin(x)
        program = torch.export.export(lin, (x,), strict=True)
    buffer = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer
    got = _load_for_executorch_from_buffer(buffer).forward((x,))[0]
    err = float((got - want).abs().max() / want.abs().max())
    log(f"lowering check {peer} group {group}: max |diff| {err:.3g} of the output's largest value")
    if err > 0.05:
        return (f"executorch's XNNPACK lowering of torchao's {peer} (group {group}) disagrees with torch on one "
                f"linear: max |diff| {err:.3g} x the output's largest value")
    return None


def torchao_peer(hf_dir: Path, out: Path, peer: str, group: int) -> None:
    """torchao's ``peer`` at ``group`` on every decoder linear of the base, lowered to XNNPACK like
    slmedge's export (``_lower``), written to ``out`` with the base's config and tokenizer."""
    import torch
    from torchao.quantization import quantize_
    from transformers import AutoModelForCausalLM

    from slmedge.export.executorch import MAX_CONTEXT, _lower

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    head = model.get_output_embeddings()
    quantize_(model, torchao_config(peer, group), filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and m is not head)
    positions = int(getattr(model.config.get_text_config(), "max_position_embeddings", MAX_CONTEXT) or MAX_CONTEXT)
    buffer = _lower(model, min(positions, MAX_CONTEXT))
    del model
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "model.pte").write_bytes(buffer)
    for name in BESIDE:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


# --- scores -----------------------------------------------------------------------------------


def score(folder: Path, model: str, args) -> dict:
    return scored(folder / "model.pte", folder.with_name(folder.name + ".score.json"), program_digest(folder),
                  (folder / "model.pte").stat().st_size, model, args, runtime="executorch", reuse=fresh)


def speed_pairs(rows: dict, work: Path, model: str, args) -> dict:
    """Prefill and decode tokens/s of each slmedge program against the peer of its layout (torchao's 8da4w at
    the same group size), ``--speed-rounds`` rounds in turns (``in_turns``); the medians and the ratios
    (slmedge / peer)."""
    out = {}
    for label, r in rows.items():
        peer = f"torchao 8da4w, group {r.get('block')}"
        if r["producer"] != "slmedge" or "failed" in r or "failed" in rows.get(peer, {"failed": 1}):
            continue
        out[label] = {"peer": peer, **in_turns(work / r["file"], work / rows[peer]["file"], model, args.speed_rounds,
                                               args.threads, runtime="executorch")}
        log(f"speed {label} vs {peer}: prefill ratio {out[label]['prefill_ratio']:.3f}, decode ratio "
            f"{out[label]['decode_ratio']:.3f} ({args.speed_rounds} rounds in turns)")
    return out


# --- the run ----------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--peers", nargs="+", default=list(PEERS), help=f"torchao's schemes: {', '.join(PEERS)} or none")
    ap.add_argument("--blocks", nargs="+", type=int, default=list(BLOCKS), help="group sizes of the peers and of "
                    "slmedge's artifacts (32 128)")
    ap.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), help=f"slmedge's programs: {', '.join(METHODS)} "
                    "or none (each at every --blocks group size the model's linears allow)")
    ap.add_argument("--calibration", default=None, help="calibration spec for slmedge's artifacts (default: slmedge's)")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--ppl-windows", type=int, default=4)
    ap.add_argument("--fidelity-windows", type=int, default=4)
    ap.add_argument("--latency", action="store_true", help="also prefill and decode tokens/s (128 + 32 tokens), and "
                    "each slmedge program against the peer of its layout in turns")
    ap.add_argument("--speed-rounds", type=int, default=3, help="rounds of the same-layout speed comparison")
    ap.add_argument("--threads", type=int, default=min(os.cpu_count() or 2, 2))
    ap.add_argument("--work", type=Path, default=ROOT / ".bench" / "executorch")
    ap.add_argument("--keep-made", action="store_true", help="reuse programs and scores in WORK made with the same "
                    "inputs by another slmedge source (runs split over a machine others edit; results.json names "
                    "the source digest of each row's program and score)")
    args = ap.parse_args()
    peers = [p for p in args.peers if p != "none"]
    methods = [m for m in args.methods if m != "none"]
    for flag, given, known in (("--peers", peers, PEERS), ("--methods", methods, tuple(METHODS))):
        unknown = [a for a in given if a not in known]
        if unknown:
            print(f"error: {flag}: unknown {unknown[0]}; choose from {', '.join(known)} or none", file=sys.stderr)
            return 2
    bad = [b for b in args.blocks if b < 32 or b % 32]
    if bad:
        print(f"error: --blocks: {bad[0]} is not a multiple of 32 (XNNPACK's group-wise kernels)", file=sys.stderr)
        return 2
    from slmedge.backends.executorch import require_executorch
    from slmedge.compress.recipe import Recipe
    from slmedge.data.calibration import calibration_sources
    from slmedge.errors import DataError, SlmedgeError
    from slmedge.study.inputs import slmedge_digest

    try:
        require_executorch()
    except SlmedgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    global CODE, KEEP_MADE
    CODE = slmedge_digest()
    KEEP_MADE = args.keep_made
    args.calibration = args.calibration or Recipe.calibration
    try:
        calibration_sources(args.calibration)
    except DataError as exc:
        print(f"error: --calibration: {exc}", file=sys.stderr)
        return 2
    for model in args.models:
        work = args.work / model
        (work / "logs").mkdir(parents=True, exist_ok=True)
        rows = make_and_score(model, work, peers, methods, args)
        print_table(model, rows)
        goal = goal_rows(rows)
        speeds = speed_pairs(rows, work, model, args) if args.latency else {}
        print_goal(model, goal, rows, speeds)
        (work / "results.json").write_text(json.dumps({"model": model, "args": {k: str(v) for k, v in vars(args).items()},
                                                       "rows": rows, "goal": goal, "speed_pairs": speeds}, indent=2))
    return 0


def make_and_score(model: str, work: Path, peers: list, methods: list, args) -> dict:
    """Every program of ``model`` made (or reused) and scored: row label -> its numbers, or its failure."""
    from slmedge.models.source import embedded_gguf_path, gguf_to_hf_dir

    hf_dir = gguf_to_hf_dir(embedded_gguf_path(model))
    widths = sorted(linear_inputs(hf_dir))
    import executorch
    import torchao

    versions = {"executorch": getattr(executorch, "__version__", "?"), "torchao": torchao.__version__}
    files: dict[str, tuple[str, Path | str, dict]] = {}  # label -> (producer, folder or failure, layout)
    checked: dict[tuple[str, int], str | None] = {}
    for peer in peers:
        for block in args.blocks:
            label = f"torchao {peer}, group {block}"
            layout = {"block": block, "scheme": peer}
            ragged = [w for w in widths if w % block]
            if ragged:
                files[label] = ("torchao", f"group {block} does not divide the linears' {ragged[0]} inputs (XNNPACK's "
                                           "group-wise kernels need it)", layout)
                continue
            out = work / f"torchao-{peer}-g{block}"
            inputs = {"model": model, "peer": peer, "block": block, **versions, "slmedge": CODE}
            failed = out.with_name(out.name + ".failed")
            if fresh(failed, inputs):
                files[label] = ("torchao", failed.read_text(), layout)
                continue
            if not fresh(out, inputs):
                why = checked.setdefault((peer, block), lowering_check(peer, block, widths[0]))
                if why:
                    failed.write_text(why)
                    stamp(failed, inputs)
                    files[label] = ("torchao", why, layout)
                    continue
                log(f"torchao {peer} group {block}")
                started = time.perf_counter()
                torchao_peer(hf_dir, out, peer, block)
                log(f"torchao {peer} group {block}: {time.perf_counter() - started:.1f} s")
                stamp(out, inputs)
            files[label] = ("torchao", out, layout)
    for method in methods:
        for block in args.blocks:
            name = f"{method.split('-')[0]}-g{block}-{method.split('-')[1]}"
            label = f"slmedge {name}, codes kept"
            layout = {"block": block, "scheme": method}
            ragged = [w for w in widths if w % block]
            if ragged:  # the export refuses it before any work: no artifact made for it
                files[label] = ("slmedge", f"group {block} does not divide the linears' {ragged[0]} inputs", layout)
                continue
            opts = METHODS[method] + ["--group-size", str(block)]
            out = work / f"slmedge-{name}"
            inputs = {"model": model, "compress": opts, "calibration": args.calibration, "nsamples": args.nsamples,
                      "seqlen": args.seqlen, "slmedge": CODE}
            if not fresh(out, inputs):
                art = work / f"artifact-{name}"
                try:
                    if not fresh(art, inputs):
                        run(slmedge("compress", model, *opts, "--calibration", args.calibration, "--nsamples",
                                    args.nsamples, "--seqlen", args.seqlen, "-o", art, "--overwrite"), f"compress {name}",
                            work / "logs" / f"compress-{name}.log")
                        stamp(art, inputs)
                    run(slmedge("export", art, "--format", "executorch", "-o", out, "--overwrite"), f"export {name}",
                        work / "logs" / f"export-{name}.log")
                except StepFailed as exc:
                    files[label] = ("slmedge", str(exc), layout)
                    continue
                stamp(out, inputs)
            files[label] = ("slmedge", out, layout)
    rows = {}
    for label, (producer, where, layout) in files.items():
        if isinstance(where, str):
            rows[label] = {"producer": producer, "failed": where, **layout}
            continue
        rows[label] = {"producer": producer, "file": where.name, **layout, **score(where, model, args),
                       "made_with": made_by(where), "scored_with": made_by(where.with_name(where.name + ".score.json"))}
    return rows


def print_table(model: str, rows: dict) -> None:
    print(f"\n### {model}\n")
    print("| program | producer | MB | mean KL | top-1 | perplexity (geo. mean) | prefill tok/s | decode tok/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    done = sorted(((k, r) for k, r in rows.items() if "failed" not in r), key=lambda kv: (kv[1]["bytes"], kv[0]))
    for label, r in done:
        tps = [f"{r[k]:.1f}" if r.get(k) else "-" for k in ("prefill_tps", "decode_tps")]
        print(f"| {label} | {r['producer']} | {r['bytes'] / 1e6:.1f} | {r['mean_kl']:.4f} | {r['top1']:.1%} | "
              f"{r['ppl_geomean']:.2f} | {tps[0]} | {tps[1]} |")
    for label, r in rows.items():
        if "failed" in r:
            print(f"| {label} | {r['producer']} | not made: {r['failed']} | | | | | |")
    grid = CAVEAT.get(model)
    if grid:
        print(f"\nCaveat: {model}'s only weights are a {grid[0]} GGUF (the base's numbers carry its quantization "
              f"noise). No row is marked: a layout that holds that grid exactly (a float zero point per block"
              f"{f' of {grid[1]}' if grid[1] else ''}) could find it again and look nearly lossless; XNNPACK's int4 "
              f"kernels are symmetric and slmedge's asymmetric codes have integer zero points, so none here does.")


def goal_rows(rows: dict) -> list[dict]:
    """Per peer program (smallest first): slmedge's smallest program of equal or smaller size better on both mean
    KL and perplexity, else the nearest miss; ``verdict``: yes, KL only, perplexity only, no, or none (no slmedge
    program that small; ``nearest``: slmedge's smallest then)."""
    scored = {k: r for k, r in rows.items() if r.get("mean_kl") is not None and r.get("ppl_geomean")}
    ours = {k: r for k, r in scored.items() if r["producer"] == "slmedge"}
    out = []
    for label, theirs in sorted(((k, r) for k, r in scored.items() if r["producer"] != "slmedge"),
                                key=lambda kv: (kv[1]["bytes"], kv[0])):
        pick, verdict = against(ours, theirs, lambda r: r["bytes"])
        row = {"peer": label, "slmedge": pick, "verdict": verdict}
        if pick is None and ours:
            row["nearest"] = min(ours, key=lambda k: (ours[k]["bytes"], k))
        out.append(row)
    return out


def print_goal(model: str, goal: list[dict], rows: dict, speeds: dict) -> None:
    print(f"\n#### {model}: each peer program against slmedge's smallest program of equal or smaller size better on both\n")
    print("| peer program | MB | KL / top-1 / ppl | slmedge program | MB | KL / top-1 / ppl | both better? |")
    print("|---|---:|---|---|---:|---|---|")
    for g in goal:
        t = rows[g["peer"]]
        name = g["slmedge"] or g.get("nearest")
        mine = rows[name] if name else None
        ours = (f"{name}{'' if g['slmedge'] else ' (larger)'} | {mine['bytes'] / 1e6:.1f} | {mine['mean_kl']:.4f} / "
                f"{mine['top1']:.1%} / {mine['ppl_geomean']:.2f}") if mine else "- | - | -"
        print(f"| {g['peer']} | {t['bytes'] / 1e6:.1f} | "
              f"{t['mean_kl']:.4f} / {t['top1']:.1%} / {t['ppl_geomean']:.2f} | {ours} | {g['verdict']} |")
    won = sum(g["verdict"] == "yes" for g in goal)
    print(f"\nQuality goal (a slmedge program of equal or smaller size better on both mean KL and perplexity): "
          f"holds at {won} of {len(goal)} peer programs.")
    if speeds:
        print(f"\n| slmedge program | peer of its layout | prefill ratio | decode ratio | ≥ {SPEED_GOAL}? |")
        print("|---|---|---:|---:|---|")
        for label, s in speeds.items():
            ok = s["prefill_ratio"] >= SPEED_GOAL and s["decode_ratio"] >= SPEED_GOAL
            print(f"| {label} | {s['peer']} | {s['prefill_ratio']:.3f} | {s['decode_ratio']:.3f} | "
                  f"{'yes' if ok else 'no'} |")
        won = sum(s["prefill_ratio"] >= SPEED_GOAL and s["decode_ratio"] >= SPEED_GOAL for s in speeds.values())
        print(f"\nSpeed goal (prefill and decode ≥ {SPEED_GOAL} of the same layout's peer): holds for {won} of "
              f"{len(speeds)} slmedge programs.")


if __name__ == "__main__":
    sys.exit(main())
