"""One sequential calibration engine for every method and architecture.

Capture the inputs of the first decoder block, then, block by block: run it with hooks on to
collect each linear's statistics, compress, run it again with hooks off so that the next block
sees the compressed outputs, move on. Only one block's weights and the calibration activations
are on the device at a time. Methods only say which statistics they need and how to compress
one linear (or, for a block-level method such as AWQ, ``Method.block_level``, one block).
"""

from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import ConfigError
from ..models.architectures import Architecture
from .blocks import BlockInputs, run_block
from .hooks import StopForward, linear_inputs, module_calls
from .methods import get_method
from .methods.base import LinearResult
from .recipe import Recipe

__all__ = ["BlockInputs", "CompressionResult", "block_linears", "capture_inputs", "collect_stats", "compress_model",
           "is_skipped", "resolve_device", "run_block"]

Progress = Callable[[str, int, int], None]


@dataclass
class CompressionResult:
    layers: dict[str, LinearResult] = field(default_factory=dict)
    # Plain data from searches (AWQ scales per mapping), saved with the artifact.
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


def resolve_device(device: str | None) -> torch.device:
    """The one place where "auto" becomes a device."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"unknown device '{device}'") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' asked for, but torch sees no CUDA GPU")
    return dev


def is_skipped(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def block_linears(layer: torch.nn.Module, arch: Architecture, prefix: str, skip) -> dict[str, torch.nn.Linear]:
    """The compressible linears of one block, by full module name, in forward order."""
    out = {}
    for rel in arch.linear_names:
        full = f"{prefix}.{rel}"
        if not is_skipped(full, skip):
            out[full] = layer.get_submodule(rel)
    return out


def _move_outside_layers(model: torch.nn.Module, layers_path: str, device: torch.device) -> None:
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if not name.startswith(layers_path + "."):
            tensor.data = tensor.data.to(device)


@torch.no_grad()
def capture_inputs(model, arch: Architecture, batches: list[torch.Tensor], device: torch.device) -> BlockInputs:
    layers = model.get_submodule(arch.layers)
    _move_outside_layers(model, arch.layers, device)
    hidden: list[torch.Tensor] = []
    kwargs: dict[tuple[int, int], dict] = {}
    seen_sizes: set[int] = set()

    def first(_name, args, kw):
        hidden.append((args[0] if args else kw["hidden_states"]).detach())
        if not full_pass:
            raise StopForward

    def every(name, args, kw):
        idx = int(name)
        kwargs[(idx, batch_size)] = {k: v for k, v in kw.items() if k != "hidden_states"}
        if idx == len(layers) - 1:
            raise StopForward  # everything after (final norm, lm_head) is not needed
        layers[idx + 1].to(device)
        if idx > 0:
            layers[idx - 1].to("cpu")

    for batch in batches:
        batch_size = batch.shape[0]
        full_pass = batch_size not in seen_sizes
        seen_sizes.add(batch_size)
        hooks = {str(i): layer for i, layer in enumerate(layers)} if full_pass else {}
        layers[0].to(device)
        try:
            with module_calls({"first": layers[0]}, first), module_calls(hooks, every):
                model(input_ids=batch.to(device), use_cache=False)
        except StopForward:
            pass
        finally:
            if device.type != "cpu":
                layers.to("cpu")
    return BlockInputs(hidden, kwargs)


@torch.no_grad()
def compress_model(
    model,
    arch: Architecture,
    recipe: Recipe,
    calibration: torch.Tensor | None,
    device: str | torch.device | None = "cpu",
    progress: Progress | None = None,
) -> CompressionResult:
    """Compress ``model`` in place and return what was done to each linear.

    ``calibration`` is (nsamples, seqlen) token ids, or None for data-free methods.
    """
    device = resolve_device(device) if not isinstance(device, torch.device) else device
    info = get_method(recipe.method)
    method = info.cls(recipe)
    needs_data = method.needs_calibration
    layers = model.get_submodule(arch.layers)
    result = CompressionResult()
    started = time.perf_counter()

    head_needs_data = method.stats_class is not None and not is_skipped(arch.lm_head, recipe.skip)
    inputs = None
    if needs_data:
        if calibration is None:
            raise ConfigError(f"{recipe.method} needs calibration data")
        batches = list(torch.split(calibration, recipe.batch_size))
        inputs = capture_inputs(model, arch, batches, device)
        result.timings["capture_s"] = time.perf_counter() - started

    for idx, layer in enumerate(layers):
        prefix = f"{arch.layers}.{idx}"
        layer.to(device)
        linears = block_linears(layer, arch, prefix, recipe.skip)
        if method.block_level:
            found, extras = method.compress_block(layer, prefix, linears, inputs, idx, arch)
            result.layers.update(found)
            result.extras.update(extras)
        elif method.stats_class is None:  # data-free: nothing to collect
            for name, linear in linears.items():
                result.layers[name] = _apply(linear, method.compress(name, linear.weight.data.float(), None))
        else:
            sequential = method.true_sequential if recipe.true_sequential is None else recipe.true_sequential
            groups = arch.sequential if sequential else (arch.linear_names,)
            for group in groups:
                todo = {f"{prefix}.{rel}": linears[f"{prefix}.{rel}"] for rel in group if f"{prefix}.{rel}" in linears}
                if not todo:
                    continue
                stats = collect_stats(layer, idx, todo, inputs, method.stats_class, device)
                for name, linear in todo.items():
                    result.layers[name] = _apply(linear, method.compress(name, linear.weight.data.float(), stats[name]))
                    del stats[name]
        # The next block (or lm_head's statistics) sees this block's compressed outputs.
        if inputs is not None and (idx < len(layers) - 1 or head_needs_data):
            inputs.hidden = [run_block(layer, h, inputs.kwargs(idx, h)) for h in inputs.hidden]
        if device.type != "cpu":
            layer.to("cpu")
        if progress:
            progress("block", idx + 1, len(layers))

    head_name = arch.lm_head
    if not is_skipped(head_name, recipe.skip):
        result.layers[head_name] = _compress_head(model, arch, method, inputs, device)
    if device.type != "cpu":
        model.to("cpu")
    result.timings["compress_s"] = time.perf_counter() - started
    return result


def collect_stats(layer, idx: int, todo: dict, inputs: BlockInputs, stats_class, device) -> dict:
    """Statistics of the inputs of ``todo``'s linears over all calibration batches.

    Each forward stops as soon as every linear of the group has seen its input (the rest of
    the block is not needed), and linears fed the very same tensor (q/k/v, gate/up) share one
    statistics object: their Hessians are identical.
    """
    stats: dict = {}
    seen: set[str] = set()
    # (address, shape) -> (name, tensor); holding the tensor keeps its address from being
    # reused by another activation within the same forward.
    fed: dict[tuple, tuple] = {}

    def on_input(name, x):
        key = (x.data_ptr(), tuple(x.shape))
        if name not in stats:
            stats[name] = stats[fed[key][0]] if key in fed else stats_class(x.shape[-1], device)
        if not any(stats[name] is stats[other] for other in seen):
            stats[name].add_batch(x)
        fed[key] = (name, x)
        seen.add(name)
        if len(seen) == len(todo):
            raise StopForward

    with linear_inputs(todo, on_input):
        for hidden in inputs.hidden:
            seen.clear()
            fed.clear()
            try:
                run_block(layer, hidden, inputs.kwargs(idx, hidden))
            except StopForward:
                pass
    return stats


def _compress_head(model, arch, method, inputs, device) -> LinearResult:
    head = model.get_submodule(arch.lm_head)
    if method.block_level:
        raise ConfigError(f"{method.name} cannot compress {arch.lm_head}; keep it in --skip")
    stats = None
    if method.stats_class is not None:
        norm = model.get_submodule(arch.final_norm)
        stats = method.stats_class(head.in_features, device)
        for hidden in inputs.hidden:
            stats.add_batch(norm(hidden))
    return _apply(head, method.compress(arch.lm_head, head.weight.data.float(), stats))


def _apply(linear: torch.nn.Linear, res: LinearResult) -> LinearResult:
    linear.weight.data.copy_(res.weight.to(linear.weight.dtype))
    # Keep results on the CPU: the artifact writer reads them there.
    for attr in ("weight", "codes", "scales", "zeros", "perm", "mask"):
        value = getattr(res, attr)
        if value is not None:
            setattr(res, attr, value.cpu())
    return res
