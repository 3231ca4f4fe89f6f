"""compress(): model source + recipe -> artifact directory. The library entry point."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.calibration import load_calibration
from ..errors import ConfigError
from ..fsutil import check_output_dir
from ..models.source import LoadedModel, load
from .artifact import MANIFEST, write_artifact
from .engine import CompressionResult, compress_model, is_skipped, resolve_device
from .methods import get_method
from .recipe import Recipe


@dataclass
class CompressOutcome:
    artifact: Path | None
    loaded: LoadedModel  # the model, compressed in memory
    result: CompressionResult
    summary: dict
    manifest: dict


def default_output(source_name: str, recipe: Recipe) -> Path:
    base = Path(source_name.rstrip("/")).name.removesuffix(".gguf").lower() or "model"
    parts = [base, recipe.method]
    if recipe.bits is not None:
        g = "ch" if recipe.group_size == -1 else recipe.group_size
        parts.append(f"w{recipe.bits}g{g}{'s' if recipe.symmetric else ''}")
    if recipe.sparsity is not None:
        parts.append("s" + recipe.sparsity.describe().replace(":", "of").replace(".", "p"))
    return Path("slmedge-out") / "-".join(parts)


def check_compatible(loaded: LoadedModel, recipe: Recipe) -> None:
    """Refuse, before any work, settings this model's layers cannot take (naming the layer)."""
    arch = loaded.arch
    spars = recipe.sparsity
    model = loaded.model
    names = [f"{arch.layers}.{i}.{rel}" for i in range(len(model.get_submodule(arch.layers))) for rel in arch.linear_names]
    if not is_skipped(arch.lm_head, recipe.skip):
        names.append(arch.lm_head)
        if get_method(recipe.method).cls.block_level:
            raise ConfigError(f"{recipe.method} cannot compress {arch.lm_head} (no preceding op to fold scales into); "
                              "keep it skipped")
    for name in names:
        if is_skipped(name, recipe.skip):
            continue
        cols = model.get_submodule(name).in_features
        if spars is not None and spars.is_nm and cols % spars.m:
            divisors = [m for m in (4, 8, 16) if cols % m == 0]
            raise ConfigError(
                f"{spars.n}:{spars.m} sparsity needs input widths divisible by {spars.m}; {name} has {cols} "
                f"(try M in {divisors})"
            )


def summarize(model, result: CompressionResult, recipe: Recipe) -> dict:
    total = sum(p.numel() for p in model.parameters())
    comp = sum(r.weight.numel() for r in result.layers.values())
    kept = sum(int(r.mask.sum()) for r in result.layers.values() if r.mask is not None)
    masked = sum(r.mask.numel() for r in result.layers.values() if r.mask is not None)
    bits = 0.0
    for r in result.layers.values():
        if r.codes is not None:
            rows, cols = r.codes.shape
            groups = r.scales.shape[1]
            zero_bits = 0 if r.spec.symmetric else r.spec.bits
            bits += r.codes.numel() * r.spec.bits + rows * groups * (16 + zero_bits)
    quantized = sum(r.codes.numel() for r in result.layers.values() if r.codes is not None)
    return {
        "recipe": recipe.describe(),
        "parameters": total,
        "compressed_parameters": comp,
        "compressed_linears": len(result.layers),
        "sparsity": round(1 - kept / masked, 6) if masked else 0.0,
        "bits_per_weight": round(bits / quantized, 4) if quantized else None,
        "timings": {k: round(v, 3) for k, v in result.timings.items()},
    }


def compress(
    model: str | None = None,
    recipe: Recipe | None = None,
    output: str | Path | None = None,
    *,
    data_dir: str | Path | None = None,
    device: str | None = "auto",
    overwrite: bool = False,
    trust_remote_code: bool = False,
    revision: str | None = None,
    text_field: str = "text",
    progress=None,
    write: bool = True,
) -> CompressOutcome:
    """Compress a model source with ``recipe`` and (unless ``write=False``) write the artifact."""
    recipe = (recipe or Recipe()).validate()
    dev = resolve_device(device)
    if write:
        output = Path(output) if output is not None else default_output(model or "smollm2-135m", recipe)
        check_output_dir(output, overwrite, MANIFEST, inputs=[model])
    started = time.perf_counter()
    loaded = load(model, revision=revision, trust_remote_code=trust_remote_code)
    load_s = time.perf_counter() - started
    check_compatible(loaded, recipe)
    method = get_method(recipe.method).cls(recipe)
    calib = None
    calib_identity = None
    if method.needs_calibration:
        calib_set = load_calibration(recipe.calibration, loaded.tokenizer, recipe.nsamples, recipe.seqlen, recipe.seed,
                                     data=data_dir, text_field=text_field)
        calib, calib_identity = calib_set.tokens, calib_set.identity
    torch.manual_seed(recipe.seed)
    result = compress_model(loaded.model, loaded.arch, recipe, calib, dev, progress)
    result.timings["load_s"] = load_s
    summary = summarize(loaded.model, result, recipe)
    manifest = {
        "recipe": recipe.to_dict(),
        "base_model": loaded.identity,
        "architecture": loaded.arch.model_type,
        "calibration": calib_identity,
        "device": str(dev),
        "timings": {k: round(v, 3) for k, v in result.timings.items()},
        "summary": summary,
    }
    artifact = None
    if write:
        artifact = write_artifact(output, loaded.model, loaded.tokenizer, result.layers, result.extras, manifest, overwrite)
    return CompressOutcome(artifact, loaded, result, summary, manifest)
