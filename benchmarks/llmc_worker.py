#!/usr/bin/env python
"""Run one compression recipe with llm-compressor and measure perplexity.

Runs INSIDE the llm-compressor virtualenv (benchmarks/llmc_env.sh), never imports slmedge.

    python llmc_worker.py --model HF_DIR --calib calib.safetensors --eval eval.safetensors \
        --recipe '{"method": "gptq", "bits": 4, "group_size": 64, "symmetric": true}' \
        --out result.json [--save-dir DIR]

calib.safetensors / eval.safetensors hold one int64 tensor `input_ids`: (nsamples, seqlen)
calibration ids used as-is (no re-tokenization), and (W, T) non-overlapping eval windows.
--recipe is a JSON string or a path to a JSON file. Methods: rtn, gptq, awq (bits, group_size,
symmetric[, actorder for gptq]); sparsegpt, wanda, magnitude (sparsity: float or "N:M").

The result JSON is always written:
  {"status": "ok"|"refused"|"unsupported"|"error", "method", "recipe", "seconds", "perplexity",
   "tokens", "check", "versions", "error"}
`seconds` times only the llmcompressor.oneshot call. `check` verifies the evaluated model really
is compressed (unique values per quantization group / fraction of zeros).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

# Model hubs are unreachable: never try them.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

QUANT_METHODS = ("rtn", "gptq", "awq")
PRUNE_METHODS = ("sparsegpt", "wanda", "magnitude")


class Outcome(Exception):
    """A non-crash end of the run: `refused` or `unsupported`, with a reason."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("llmcompressor", "compressed-tensors", "torch", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _load_recipe(text: str) -> dict:
    path = Path(text)
    if not text.lstrip().startswith("{") and path.is_file():
        text = path.read_text()
    recipe = json.loads(text)
    if not isinstance(recipe, dict) or "method" not in recipe:
        raise ValueError(f"recipe must be a JSON object with a 'method': {text!r}")
    recipe["method"] = str(recipe["method"]).lower()
    return recipe


def _mask_structure(sparsity) -> tuple[float, str]:
    """(sparsity fraction, llm-compressor mask_structure) from 0.5 or "2:4"."""
    if isinstance(sparsity, str) and ":" in sparsity:
        n, m = (int(x) for x in sparsity.split(":"))
        return n / m, f"{n}:{m}"
    return float(sparsity), "0:0"


def _quant_config_groups(recipe: dict) -> dict:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=int(recipe.get("bits", 4)),
        type="int",
        symmetric=bool(recipe.get("symmetric", True)),
        strategy="group",
        group_size=int(recipe.get("group_size", 128)),
    )
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}


def build_modifiers(recipe: dict):
    """llm-compressor modifier(s) for our recipe JSON (llmcompressor 0.14 API)."""
    method = recipe["method"]
    if method == "rtn":
        from llmcompressor.modifiers.quantization import QuantizationModifier

        return QuantizationModifier(
            config_groups=_quant_config_groups(recipe), targets=["Linear"], ignore=["lm_head"]
        )
    if method == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        kwargs = {}
        if "actorder" in recipe:  # else their default ("static" == "weight")
            kwargs["actorder"] = recipe["actorder"] or None
        if "damp" in recipe:
            kwargs["dampening_frac"] = float(recipe["damp"])
        if "block_size" in recipe:
            kwargs["block_size"] = int(recipe["block_size"])
        return GPTQModifier(
            config_groups=_quant_config_groups(recipe),
            targets=["Linear"],
            ignore=["lm_head"],
            **kwargs,
        )
    if method == "awq":
        # 0.14: AWQ is a transform (smoothing) followed by a quantization modifier.
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQModifier

        return [
            AWQModifier(),
            QuantizationModifier(
                config_groups=_quant_config_groups(recipe), targets=["Linear"], ignore=["lm_head"]
            ),
        ]
    if method in ("sparsegpt", "wanda"):
        sparsity, structure = _mask_structure(recipe["sparsity"])
        if method == "sparsegpt":
            from llmcompressor.modifiers.pruning import SparseGPTModifier as cls
        else:
            from llmcompressor.modifiers.pruning import WandaPruningModifier as cls
        # Their documented form: every Linear (= the decoder layers' linears), minus lm_head.
        return cls(
            sparsity=sparsity, mask_structure=structure, targets=["Linear"], ignore=["re:.*lm_head"]
        )
    if method == "magnitude":
        from llmcompressor.modifiers.pruning import MagnitudePruningModifier

        sparsity, structure = _mask_structure(recipe["sparsity"])
        return MagnitudePruningModifier(
            targets=[r"re:.*layers\.\d+\..*(proj|fc\d?)$"],
            init_sparsity=sparsity,
            final_sparsity=sparsity,
            mask_structure="unstructured" if structure == "0:0" else structure,
            start=0,
            end=1,
        )
    raise Outcome("unsupported", f"unknown method {method!r}")


def _placeholder_processor():
    """Calibration ids are pre-tokenized, so the processor is never used; oneshot still
    insists on loading one when a dataset is given. Use the model's tokenizer when it loads,
    else this stand-in (only the 'truncation' collator runs, which ignores it)."""

    class _NoProcessor:
        def save_pretrained(self, *_a, **_k):
            pass

    return _NoProcessor()


def _load_processor(model_dir: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir), "tokenizer"
    except Exception as exc:  # tiny test models have none; it is never used anyway
        return _placeholder_processor(), f"placeholder ({type(exc).__name__})"


def _linear_layers(model):
    import torch

    return [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")
    ]


def check_quantized(model, recipe: dict, orig: dict) -> dict:
    """Effective (fake-quantized) weight of every quantized Linear: at most 2**bits distinct
    values per group, and the module's forward equals F.linear with that weight."""
    import torch
    import torch.nn.functional as F

    bits = int(recipe.get("bits", 4))
    layers = [(n, m) for n, m in _linear_layers(model) if getattr(m, "quantization_scheme", None)]
    if not layers:
        return {"ok": False, "reason": "no Linear carries a quantization_scheme"}
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    max_unique, n_groups, stored_on_grid, worst_fwd = 0, 0, True, 0.0
    first = None
    for name, m in layers:
        args = m.quantization_scheme.weights
        w = m.weight.data
        w_eff = forward_quantize(m, w, "weight", args)
        gs = args.group_size or w.shape[1]
        g_idx = getattr(m, "weight_g_idx", None)
        if g_idx is not None and (g_idx.view(-1) >= 0).all():
            order = torch.argsort(g_idx.view(-1), stable=True)
            grouped = w_eff[:, order].reshape(w.shape[0], -1, gs)
        else:
            grouped = w_eff.reshape(w.shape[0], -1, gs)
        flat = grouped.reshape(-1, gs)
        uniq = max(int(torch.unique(row).numel()) for row in flat)
        max_unique = max(max_unique, uniq)
        n_groups += flat.shape[0]
        stored_on_grid &= bool(torch.equal(w_eff, w))
        x = torch.randn(3, w.shape[1], dtype=w.dtype, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            diff = (m(x) - F.linear(x, w_eff, m.bias)).abs().max().item()
            diff_fp = (F.linear(x, w, m.bias) - F.linear(x, w_eff, m.bias)).abs().max().item()
        worst_fwd = max(worst_fwd, diff)
        if first is None:
            first = {
                "layer": name,
                "group_size": gs,
                "observer": getattr(args, "observer", None),
                "actorder": str(getattr(args, "actorder", None)),
                "status": str(getattr(m, "quantization_status", None)),
                "max_abs_stored_minus_effective": float((w - w_eff).abs().max()),
                "fwd_diff_stored_vs_effective": diff_fp,
            }
            if name in orig:  # how far the compressed weight moved from the original
                w0 = orig[name]
                first["rel_err_vs_original"] = float((w_eff - w0).norm() / w0.norm())
    return {
        "ok": max_unique <= 2**bits and worst_fwd < 1e-4,
        "quantized_linears": len(layers),
        "groups": n_groups,
        "max_unique_per_group": max_unique,
        "limit": 2**bits,
        "stored_weight_is_quantized": stored_on_grid,
        "max_forward_vs_fakequant_diff": worst_fwd,
        "first_layer": first,
    }


def check_sparsity(model, recipe: dict) -> dict:
    import torch

    target, structure = _mask_structure(recipe["sparsity"])
    zeros = total = 0
    per_layer = {}
    nm_ok = True
    for name, m in _linear_layers(model):
        w = m.weight.data
        z = int((w == 0).sum())
        zeros += z
        total += w.numel()
        per_layer[name] = round(z / w.numel(), 4)
        if structure != "0:0":
            n, mm = (int(x) for x in structure.split(":"))
            blocks = (w.reshape(w.shape[0], -1, mm) == 0).sum(-1)
            nm_ok &= bool((blocks >= n).all())
    frac = zeros / max(total, 1)
    out = {
        "ok": abs(frac - target) < 0.02 and (structure == "0:0" or nm_ok),
        "zero_fraction": round(frac, 5),
        "target": target,
        "mask_structure": structure,
        "linears": len(per_layer),
        "min_layer_zero_fraction": min(per_layer.values()) if per_layer else None,
        "max_layer_zero_fraction": max(per_layer.values()) if per_layer else None,
    }
    if structure != "0:0":
        out["n_m_pattern_ok"] = nm_ok
    return out


def perplexity(model, eval_ids) -> tuple[float, int]:
    import torch
    import torch.nn.functional as F

    nll, count = 0.0, 0
    with torch.no_grad():
        for window in eval_ids:
            window = window.to(torch.long)
            logits = model(window[None]).logits[0, :-1]
            nll += F.cross_entropy(logits.float(), window[1:], reduction="sum").item()
            count += window.numel() - 1
    return math.exp(nll / count), count


def run(args, result: dict) -> None:
    import torch
    from datasets import Dataset
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    recipe = result["recipe"]
    method = recipe["method"]
    calib = load_file(args.calib)["input_ids"].to(torch.int64)
    eval_ids = load_file(args.eval)["input_ids"].to(torch.int64)
    nsamples, seqlen = calib.shape

    modifiers = build_modifiers(recipe)  # raises Outcome("unsupported") for unknown methods

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    processor, result["processor"] = _load_processor(args.model)
    # keep the first Linear's original weight, for the check
    orig = {n: m.weight.detach().clone() for n, m in _linear_layers(model)[:1]}
    rows = calib.tolist()
    ds = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * seqlen for _ in rows]})

    from llmcompressor import oneshot

    t0 = time.perf_counter()
    try:
        model = oneshot(
            model=model,
            processor=processor,
            dataset=ds,
            recipe=modifiers,
            num_calibration_samples=nsamples,
            max_seq_length=seqlen,
            shuffle_calibration_samples=False,
            batch_size=1,
        ) or model
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}"
        # llmcompressor 0.14's AWQ pins its activation cache (IntermediatesCache.pin_memory),
        # which needs an accelerator: on CPU it stops with "Cannot access accelerator device".
        lowered = msg.lower()
        if not torch.cuda.is_available() and any(
            k in lowered for k in ("accelerator", "cuda", "gpu", "pin_memory")
        ):
            raise Outcome("refused", msg) from exc
        raise
    result["seconds"] = time.perf_counter() - t0

    if method in QUANT_METHODS:
        result["check"] = check_quantized(model, recipe, orig)
    else:
        result["check"] = check_sparsity(model, recipe)
        if method == "magnitude" and result["check"]["zero_fraction"] < 0.01:
            n_masked = len(getattr(modifiers, "parameterized_layers_", None) or {})
            raise Outcome(
                "unsupported",
                "MagnitudePruningModifier only multiplies its masks into the weights on "
                "optimizer steps (training); oneshot leaves the weights dense "
                f"(masks built for {n_masked} linears, zero fraction "
                f"{result['check']['zero_fraction']})",
            )

    result["perplexity"], result["tokens"] = perplexity(model, eval_ids)
    result["status"] = "ok" if result["check"].get("ok") else "error"
    if result["status"] == "error":
        result["error"] = "compression check failed: the evaluated model is not compressed as asked"

    if args.save_dir:
        try:
            model.save_pretrained(args.save_dir, save_compressed=True)
            result["saved_to"] = args.save_dir
        except Exception as exc:  # saving is optional; keep the measurement
            result["save_error"] = f"{type(exc).__name__}: {exc}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="local Hugging Face model folder")
    p.add_argument("--calib", required=True, help="safetensors with input_ids (nsamples, seqlen)")
    p.add_argument("--eval", required=True, help="safetensors with input_ids (W, T)")
    p.add_argument("--recipe", required=True, help="JSON string or path to a JSON file")
    p.add_argument("--out", required=True, help="result JSON path")
    p.add_argument("--save-dir", default=None, help="optional: save the compressed model here")
    args = p.parse_args(argv)

    result = {
        "status": "error",
        "method": None,
        "recipe": None,
        "seconds": None,
        "perplexity": None,
        "tokens": None,
        "check": None,
        "versions": {},
        "error": None,
    }
    try:
        result["versions"] = _versions()
        result["recipe"] = _load_recipe(args.recipe)
        result["method"] = result["recipe"]["method"]
        run(args, result)
    except Outcome as exc:
        result["status"] = exc.status
        result["error"] = str(exc)
        if exc.__cause__ is not None:
            result["traceback"] = "".join(
                traceback.format_exception(exc.__cause__, limit=-6)
            )
    except BaseException as exc:  # noqa: BLE001 - the JSON must always be written
        result["status"] = "error"
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc(limit=8)
    finally:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({k: result[k] for k in ("status", "method", "seconds", "perplexity", "error")}))
    return 0 if result["status"] in ("ok", "refused", "unsupported") else 1


if __name__ == "__main__":
    sys.exit(main())
