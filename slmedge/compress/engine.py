"""One sequential calibration engine for every method and architecture.

Capture the inputs of the first decoder block, then, block by block: run it with hooks on to
collect each linear's statistics, compress, run it again with hooks off so that the next block
sees the compressed outputs, move on. Only one block's weights and the calibration activations
are on the device at a time. Methods only say which statistics they need and how to compress
one linear (or, for a block-level method such as AWQ, ``Method.block_level``, one block).
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import CaptureError, ConfigError
from ..fsutil import memory_available
from ..models.architectures import Architecture
from .blocks import BlockInputs, run_block
from .hooks import StopForward, linear_inputs, module_calls
from .layouts import Layout, layout_of
from .methods import get_method
from .methods.base import InputNormStats, LinearResult
from .recipe import Recipe
from .shortcuts import BlockShortcuts, Checks, plan_bytes

__all__ = ["BlockInputs", "CompressionResult", "Sink", "block_linears", "capture_inputs", "collect_stats",
           "compress_model", "is_skipped", "resolve_device", "run_block"]

Progress = Callable[[str, int, int], None]


@dataclass
class CompressionResult:
    layers: dict[str, LinearResult] = field(default_factory=dict)
    # Plain data from searches (AWQ scales per mapping), saved with the artifact.
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # Per compressed linear: parameters, kept / masked weights and the bits of its codes (``layer_counts``),
    # what the artifact's summary reports; kept when a sink took the tensors themselves.
    counts: dict[str, dict] = field(default_factory=dict)
    # What the method fixed from the device where the recipe said "auto" (``Method.resolve``).
    resolved: dict = field(default_factory=dict)


def layer_counts(res: LinearResult) -> dict:
    """What one compressed linear adds to the summary: its parameters, kept and masked weights, and
    the bits of its codes (each code's bits plus, per group, an fp16 scale and a zero point; on a
    llama.cpp grid, its GGUF blocks' bits: codes, scales, mins and sub-block codes)."""
    out = {"parameters": res.weight.numel(), "kept": 0, "masked": 0, "quantized": 0, "code_bits": 0}
    if res.mask is not None:
        out["kept"], out["masked"] = int(res.mask.sum()), res.mask.numel()
    if res.codes is not None:
        out["quantized"] = res.codes.numel()
        if res.fields is not None:  # a llama.cpp grid: its GGUF blocks' bits
            out["code_bits"] = round(res.codes.numel() * res.spec.bits_per_weight)
        else:
            rows = res.codes.shape[0]
            groups = res.scales.shape[1]
            zero_bits = 0 if res.spec.symmetric else res.spec.bits
            out["code_bits"] = res.codes.numel() * res.spec.bits + rows * groups * (16 + zero_bits)
            layout = layout_of(res.spec)
            if layout is not None:  # as MatMulNBits stores it (what an ONNX budget counts)
                out["onnx_bits"] = layout.linear_bits(rows, res.codes.shape[1])
    return out


def _slim(res: LinearResult) -> LinearResult:
    """A result without its tensors (a sink has them): only its quantization spec."""
    return LinearResult(weight=None, spec=res.spec)


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


def _move_outside_layers(model: torch.nn.Module, layers_path: str, device: torch.device,
                         dtype: torch.dtype | None = None) -> None:
    """Move (and, with ``dtype``, cast the floating point tensors of) everything outside the decoder
    blocks: embeddings, final norm, lm_head, rotary buffers. Tied tensors are one parameter."""
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if not name.startswith(layers_path + "."):
            cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            tensor.data = tensor.data.to(device, cast)


def _to_compute(module: torch.nn.Module, device: torch.device) -> None:
    """Move ``module`` to ``device`` in fp32, in memory of its own.

    A tensor that ``.to()`` leaves where it is (already fp32 on the CPU) is copied: a source loaded
    from safetensors is memory-mapped, and each first write into a mapped page (RTN rounds in place,
    every method writes its result back) costs a copy-on-write fault. Over SmolLM2-135M's fp32
    linears (424 MB) that took 1.6 s; reading them into fresh memory takes 0.2 s, and the source's
    file is never written either way (its mapping is private)."""
    def tensors():
        return itertools.chain(module.named_parameters(), module.named_buffers())

    before = {name: t.data_ptr() for name, t in tensors()}
    module.to(device, torch.float32)
    for name, t in tensors():
        if t.device.type == "cpu" and t.is_floating_point() and t.data_ptr() == before[name]:
            t.data = t.data.clone()


@torch.no_grad()
def capture_inputs(model, arch: Architecture, batches: list[torch.Tensor], device: torch.device) -> BlockInputs:
    """The hidden states entering the first block (per batch) and every block's call kwargs.

    No block computes anything here: each is replaced, for the capture pass only, by a
    pass-through that records what the model's own forward hands it (rotary embeddings, masks:
    Gemma's sliding-window layers get their own) and stops the pass after the last block (after
    the first, once a batch size was seen). The blocks' weights are not touched, so they may still
    be in the source's dtype or on the CPU.

    The pass-through returns what the real block would: the model's loop reads it (Gemma 2/3 under
    transformers 4.x index a tuple, ``layer_outputs[0]``; other loops take the tensor itself), so its
    form is learned from one forward of the block on the meta device (``_block_output_form``: no
    weight is read, nothing is computed). Every block must be handed (batch, tokens, hidden) states:
    anything else is an error naming the block, not calibration on the wrong activations.
    """
    layers = model.get_submodule(arch.layers)
    _move_outside_layers(model, arch.layers, device)
    hidden: list[torch.Tensor] = []
    kwargs: dict[tuple[int, int], dict] = {}
    seen_sizes: set[int] = set()
    forms: dict[type, Callable[[torch.Tensor], object]] = {}
    width = getattr(model.config, "hidden_size", None)

    def pass_through(idx, layer):
        def forward(*args, **kw):
            h = args[0] if args else kw["hidden_states"]
            expected = (*batch.shape, width if width is not None else h.shape[-1])
            if tuple(h.shape) != expected:
                raise CaptureError(
                    f"the capture pass handed decoder block {idx} hidden states of shape {tuple(h.shape)}, "
                    f"expected {expected} (batch, tokens, hidden): the model's loop reads its blocks' output in a "
                    "way slmedge does not stand in for; please report it with the model and transformers version")
            if idx == 0:
                hidden.append(h.detach())
            if full_pass:
                kwargs[(idx, batch_size)] = {k: v for k, v in kw.items() if k != "hidden_states"}
            if not full_pass or idx == len(layers) - 1:
                raise StopForward  # everything after (final norm, lm_head) is not needed
            if type(layer) not in forms:
                forms[type(layer)] = _block_output_form(layer, idx, args, kw)
            return forms[type(layer)](h)
        return forward

    for idx, layer in enumerate(layers):
        layer.forward = pass_through(idx, layer)  # an instance attribute: nn.Module.__call__ finds it first
    try:
        for batch in batches:
            batch_size = batch.shape[0]
            full_pass = batch_size not in seen_sizes
            seen_sizes.add(batch_size)
            try:
                model(input_ids=batch.to(device), use_cache=False)
            except StopForward:
                pass
    finally:
        for layer in layers:
            del layer.forward
    return BlockInputs(hidden, kwargs)


def _block_output_form(layer: torch.nn.Module, idx: int, args: tuple, kw: dict) -> Callable[[torch.Tensor], object]:
    """How ``layer``'s real forward packs its output, as a function of the hidden states to return.

    Learned from one call of the block's own forward on the meta device, with these arguments: shapes
    and types only (no weight is read, nothing is computed; forward hooks on the block's modules see that
    one call, with meta tensors). A bare tensor, or a tuple whose first
    element is the hidden states and the rest None (no attention weights or cache are asked for)."""
    h = args[0] if args else kw["hidden_states"]

    def meta(value, dtype=None):
        if isinstance(value, torch.Tensor):
            return torch.empty_like(value, device="meta", dtype=dtype if value.is_floating_point() else None)
        if isinstance(value, (tuple, list)):
            return type(value)(meta(v) for v in value)
        if isinstance(value, dict):
            return {k: meta(v) for k, v in value.items()}
        return value

    # The block as it will compute: its floating tensors in the hidden states' dtype (the engine casts
    # each block to fp32 at its turn; a bf16 source's blocks are still bf16 here).
    state = {name: meta(t, h.dtype) for name, t in itertools.chain(layer.named_parameters(), layer.named_buffers())}
    instance_forward = layer.__dict__.pop("forward")  # the class's forward, for this one call
    try:
        out = torch.func.functional_call(layer, state, meta(args), meta(kw))
    except Exception as exc:  # noqa: BLE001 - any failure here means the form is unknown
        raise CaptureError(f"cannot learn what decoder block {idx} ({type(layer).__name__}) returns: "
                           f"{type(exc).__name__}: {exc}") from exc
    finally:
        layer.forward = instance_forward
    first = out[0] if isinstance(out, tuple) else out
    rest = out[1:] if isinstance(out, tuple) else ()
    if not isinstance(first, torch.Tensor) or tuple(first.shape) != tuple(h.shape) or any(r is not None for r in rest):
        raise CaptureError(f"decoder block {idx} ({type(layer).__name__}) returns {_describe(out)}, not its hidden "
                           f"states of shape {tuple(h.shape)} (alone or first in a tuple of Nones)")
    if isinstance(out, tuple):
        return lambda hidden_states: (hidden_states, *rest)
    return lambda hidden_states: hidden_states


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, tuple):
        return "a tuple of (" + ", ".join(_describe(v) for v in value) + ")"
    return type(value).__name__


# What the engine hands a sink after each block (and once more for everything outside the blocks):
# that part's tensors by full name (compressed linears hold their fp32 dequantized weights), the
# results of its linears and the searches' extras. The sink keeps what it needs; the block is
# freed after it returns.
Sink = Callable[[dict[str, torch.Tensor], dict[str, LinearResult], dict[str, torch.Tensor]], None]


@torch.no_grad()
def compress_model(
    model,
    arch: Architecture,
    recipe: Recipe,
    calibration: torch.Tensor | None,
    device: str | torch.device | None = "cpu",
    progress: Progress | None = None,
    sink: Sink | None = None,
    shortcuts: bool = True,
) -> CompressionResult:
    """Compress ``model`` in place and return what was done to each linear.

    ``calibration`` is (nsamples, seqlen) token ids, or None for data-free methods. The model may
    be in any floating dtype (its source's): everything is computed in fp32, one block at a time
    (a block is cast to fp32 when its turn comes; the tensors outside the blocks are cast at the
    start, exactly, as fp32 holds every bf16/fp16 value).

    With a ``sink`` the model is consumed as it goes: each finished block is handed to it and then
    freed (its tensors moved to the meta device), and its results keep only their spec (``_slim``;
    ``CompressionResult.counts`` has what the summary needs), so that no more than one block is ever in fp32. Without
    one the model stays whole, compressed in memory, and the results keep their tensors.

    True-sequential passes skip what has not changed since an earlier pass (``compress.shortcuts``:
    the same bits, about half the block forwards) where the recorded activations fit in memory;
    ``shortcuts=False`` runs every pass from the block's input.
    """
    device = resolve_device(device) if not isinstance(device, torch.device) else device
    info = get_method(recipe.method)
    method = info.cls(recipe)
    needs_data = method.needs_calibration
    layers = model.get_submodule(arch.layers)
    result = CompressionResult(resolved=method.resolve(device))
    started = time.perf_counter()
    if sink is not None:
        _bound_heap()
    outside_source = _source_ranges(model, skip=arch.layers + ".") if sink is not None else []
    _move_outside_layers(model, arch.layers, device, torch.float32)
    _page_out(outside_source)  # now in fp32 memory of their own

    head_needs_data = method.stats_class is not None and not is_skipped(arch.lm_head, recipe.skip)
    inputs = None
    if needs_data:
        if calibration is None:
            raise ConfigError(f"{recipe.method} needs calibration data")
        batches = list(torch.split(calibration, recipe.batch_size))
        inputs = capture_inputs(model, arch, batches, device)
        result.timings["capture_s"] = time.perf_counter() - started
    if recipe.bpw is not None:
        began = time.perf_counter()
        method.assigned = budget_grids(model, arch, recipe, inputs, device, progress)
        result.timings["budget_s"] = time.perf_counter() - began
    if not (method.block_level or method.stats_class is not None):
        inputs = None  # a data-free method that calibrated only for its budget: nothing to propagate

    checks = None  # the short-cuts' checks (shortcuts.Checks), False where they do not fit
    plan = None
    for idx, layer in enumerate(layers):
        prefix = f"{arch.layers}.{idx}"
        source = _source_ranges(layer) if sink is not None else []
        _to_compute(layer, device)
        _page_out(source)  # the block's source pages: read once, now in fp32 memory of its own
        linears = block_linears(layer, arch, prefix, recipe.skip)
        found: dict[str, LinearResult] = {}
        extras: dict[str, torch.Tensor] = {}
        if method.block_level:
            found, extras = method.compress_block(layer, prefix, linears, inputs, idx, arch)
        elif method.stats_class is None:  # data-free: nothing to collect
            for name, linear in linears.items():
                found[name] = _apply(linear, method.compress(name, linear.weight.data.float(), None))
        else:
            sequential = method.true_sequential if recipe.true_sequential is None else recipe.true_sequential
            groups = [[rel for rel in group if f"{prefix}.{rel}" in linears]
                      for group in (arch.sequential if sequential else (arch.linear_names,))]
            groups = [group for group in groups if group]
            if shortcuts and len(groups) > 1 and checks is not False:
                if checks is None:  # decided once, on the first block (every block has the same widths)
                    checks = Checks() if _shortcuts_fit(layer, groups, inputs, device) else False
                plan = BlockShortcuts(layer, groups, checks) if checks else None
            for gi, group in enumerate(groups):
                todo = {f"{prefix}.{rel}": linears[f"{prefix}.{rel}"] for rel in group}
                stats = collect_stats(layer, idx, todo, inputs, method.stats_class, device,
                                      forward=None if plan is None else functools.partial(plan.forward, gi))
                for names in _sharing(stats, todo):
                    done = method.compress_shared({n: todo[n].weight.data.float() for n in names}, stats[names[0]])
                    for name in names:
                        found[name] = _apply(todo[name], done.pop(name))
                        del stats[name]
                if plan is not None:
                    plan.after_group(gi)
            found = {name: found[name] for name in linears if name in found}  # forward order
        # The next block (or lm_head's statistics) sees this block's compressed outputs; each
        # batch's new hidden states replace the old ones at once (one copy of them at a time).
        if inputs is not None and (idx < len(layers) - 1 or head_needs_data):
            for i, h in enumerate(inputs.hidden):
                inputs.hidden[i] = (run_block(layer, h, inputs.kwargs(idx, h)) if plan is None
                                    else plan.forward(None, i, h, inputs.kwargs(idx, h)))
        plan = None
        result.counts.update({name: layer_counts(res) for name, res in found.items()})
        if sink is not None:
            sink({k: v.detach().cpu() for k, v in layer.state_dict(prefix=prefix + ".").items()}, found, extras)
            layer.to("meta")
            found = {name: _slim(res) for name, res in found.items()}
            _return_freed_memory()
        elif device.type != "cpu":
            layer.to("cpu")
        result.layers.update(found)
        result.extras.update(extras)
        if progress:
            progress("block", idx + 1, len(layers))

    head_name = arch.lm_head
    outside: dict[str, LinearResult] = {}
    if not is_skipped(head_name, recipe.skip):
        outside[head_name] = _compress_head(model, arch, method, inputs, device)
    _move_outside_layers(model, arch.layers, torch.device("cpu"))
    result.counts.update({name: layer_counts(res) for name, res in outside.items()})
    if sink is not None:
        rest = {k: v.detach() for k, v in model.state_dict().items() if not k.startswith(arch.layers + ".")}
        sink(rest, outside, {})
        outside = {name: _slim(res) for name, res in outside.items()}
    result.layers.update(outside)
    result.timings["compress_s"] = time.perf_counter() - started
    return result


# The budget's output weights (budget_grids): measured on the first calibration batches up to this many
# tokens, with noise of this size relative to each row's root mean square (small enough to act linearly).
REACH_TOKENS = 4096
REACH_NOISE = 1e-2


@torch.no_grad()
def output_reach(layer, todo: dict, batches: list, kwargs_of, seed: int) -> dict[str, float]:
    """Per linear of ``layer`` (fp32, on the compute device), over the first ``batches`` up to
    ``REACH_TOKENS`` tokens: how much of the block's output an error of
    its weight moves, ``E|y|^2 * (E|dh|^2 / E|dy|^2) / E|h|^2``: its output's energy, times the share of a
    small change of that output (``dy``, from seeded noise in the weight) that reaches the block's output
    (``dh``), over the block output's energy (the residual stream, h). A linear's noise-to-signal ratio
    on a grid times this is the relative error of the residual stream it causes: what makes the linears
    of one block (q/k behind a softmax, v and o straight on, a projection behind a norm) and of
    different blocks comparable."""
    taken, seen = [], 0
    for h in batches:  # the first batches, up to REACH_TOKENS tokens
        if seen >= REACH_TOKENS:
            break
        taken.append(h)
        seen += h.shape[0] * h.shape[1]
    batches = taken
    clean = [run_block(layer, h, kwargs_of(h)) for h in batches]
    total = sum(float(o.double().pow(2).sum()) for o in clean)
    reach = {}
    for k, (name, lin) in enumerate(todo.items()):
        weight = lin.weight.data
        g = torch.Generator().manual_seed(seed * 1009 + k)
        noise = torch.randn(weight.shape, generator=g).to(weight.device, weight.dtype)
        noise *= REACH_NOISE * weight.pow(2).mean(dim=1, keepdim=True).sqrt()
        energy = [0.0, 0.0]  # |dy|^2, |y|^2

        def hook(_mod, args, output, noise=noise, energy=energy):
            dy = args[0] @ noise.t()
            energy[0] += float(dy.double().pow(2).sum())
            energy[1] += float((output - dy).double().pow(2).sum())

        kept = weight.clone()
        handle = lin.register_forward_hook(hook)
        try:
            weight += noise
            moved = sum(float((run_block(layer, h, kwargs_of(h)) - c).double().pow(2).sum())
                        for h, c in zip(batches, clean))
        finally:
            handle.remove()
            weight.copy_(kept)
        reach[name] = energy[1] * (moved / energy[0]) / total if energy[0] > 0 and total > 0 else 0.0
    return reach


@torch.no_grad()
def budget_grids(model, arch: Architecture, recipe: Recipe, inputs: BlockInputs, device, progress=None) -> dict:
    """The llama.cpp grid (or, for an ONNX budget, the MatMulNBits layout's ``QuantSpec``) of every compressed
    linear for ``recipe.bpw`` (``compress.budget``): one pass of
    the uncompressed model over the calibration data measures each linear's input mean squares and, from
    them, the noise-to-signal ratio of its output on each grid, weighted by how much of the residual
    stream its output moves (``output_reach``); the allocation then picks the grids. Each block is
    worked on as an fp32 copy (the model itself is not changed); the hidden states are the pass's own."""
    from .budget import allocate, candidates, sensitivity

    layers = model.get_submodule(arch.layers)
    hidden = list(inputs.hidden)
    shapes, errors = {}, {}
    weighted = recipe.importance is not False

    def measure(name, weight, stats, reach=1.0):
        shapes[name] = tuple(weight.shape)
        ratios = sensitivity(weight, stats.importance(), candidates(weight.shape[1], recipe.bpw_grids), weighted)
        errors[name] = {grid: ratio * reach for grid, ratio in ratios.items()}

    for idx, layer in enumerate(layers):
        work = copy.deepcopy(layer)
        _to_compute(work, device)
        todo = block_linears(work, arch, f"{arch.layers}.{idx}", recipe.skip)
        stats = collect_stats(work, idx, todo, BlockInputs(hidden, inputs._kwargs), InputNormStats, device)
        reach = output_reach(work, todo, hidden, lambda h: inputs.kwargs(idx, h), idx)
        for name, lin in todo.items():
            measure(name, lin.weight.data, stats[name], reach[name])
        for i, h in enumerate(hidden):
            hidden[i] = run_block(work, h, inputs.kwargs(idx, h))
        del work, stats
        if progress:
            progress("sensitivity", idx + 1, len(layers))
    if not is_skipped(arch.lm_head, recipe.skip):
        head, norm = model.get_submodule(arch.lm_head), model.get_submodule(arch.final_norm)
        stats = InputNormStats(head.in_features, device)
        for h in hidden:
            stats.add_batch(norm(h))
        measure(arch.lm_head, head.weight.data.float(), stats)  # its output is the logits: the ratio as it is
    picked = allocate(shapes, errors, recipe.bpw)
    if picked is None:  # check_budget refused what no choice reaches: this is not expected
        raise ConfigError(f"no choice of {'the ONNX layouts' if recipe.on_layouts else 'llama.cpp grids'} lands "
                          f"within the budget of {recipe.bpw:g} bits per weight")
    from .budget import choice

    # a layout's uniform grid (QuantSpec) is what the method rounds onto and the artifact keeps
    chosen = {name: choice(g) for name, g in picked.items()}
    return {name: c.spec if isinstance(c, Layout) else c for name, c in chosen.items()}


def _shortcuts_fit(layer, groups, inputs: BlockInputs, device) -> bool:
    """Whether the short-cuts' recorded activations take at most a quarter of the memory available."""
    tokens = sum(h.shape[0] * h.shape[1] for h in inputs.hidden)
    need = plan_bytes(layer, groups, tokens)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = memory_available()
    return free is not None and need <= free // 4


def collect_stats(layer, idx: int, todo: dict, inputs: BlockInputs, stats_class, device, forward=None,
                  shared_stop: bool = True) -> dict:
    """Statistics of the inputs of ``todo``'s linears over all calibration batches.

    Each forward stops as soon as every linear of the group has seen its input (the rest of
    the block is not needed), and linears fed the very same tensor (q/k/v, gate/up) share one
    statistics object: their Hessians are identical. ``forward(batch_index, hidden, kwargs)``
    replaces the plain block forward (the true-sequential short-cuts).

    Which linears share a tensor is seen on the first batch, where the forward runs until every
    linear of the group has been reached. On the later batches the block runs the same code on
    other values, so the first linear of such a set already stands for the others and the pass
    stops there: q/k/v's pass computes no q_proj or k_proj, gate/up's no gate_proj (the same
    statistics: ``shared_stop=False`` runs every batch to the group's last linear).
    """
    stats: dict = {}
    seen: set[str] = set()
    # (address, shape, strides) -> (name, tensor); holding the tensor keeps its address from being
    # reused by another activation within the same forward.
    fed: dict[tuple, tuple] = {}
    learning = True  # whether this batch runs to every linear (see above)

    def on_input(name, x):
        key = (x.data_ptr(), tuple(x.shape), x.stride())
        if name not in stats:
            stats[name] = stats[fed[key][0]] if key in fed else stats_class(x.shape[-1], device)
        if not any(stats[name] is stats[other] for other in seen):
            stats[name].add_batch(x)
        fed[key] = (name, x)
        if learning:
            seen.add(name)
        else:  # the linears sharing this one's statistics were fed the same tensor on the first batch
            seen.update(other for other, st in stats.items() if st is stats[name])
        if len(seen) == len(todo):
            raise StopForward

    with linear_inputs(todo, on_input):
        for i, hidden in enumerate(inputs.hidden):
            seen.clear()
            fed.clear()
            learning = not shared_stop or i == 0 or len(stats) < len(todo)  # until all were reached once
            try:
                if forward is None:
                    run_block(layer, hidden, inputs.kwargs(idx, hidden))
                else:
                    forward(i, hidden, inputs.kwargs(idx, hidden))
            except StopForward:
                pass
    return stats


def _sharing(stats: dict, todo: dict) -> list[list[str]]:
    """``todo``'s linears grouped by the statistics object they share (``collect_stats`` gives one
    to the linears fed the very same tensor), in forward order."""
    groups: dict[int, list[str]] = {}
    for name in todo:
        groups.setdefault(id(stats[name]), []).append(name)
    return list(groups.values())


def _compress_head(model, arch, method, inputs, device) -> LinearResult:
    head = model.get_submodule(arch.lm_head)
    if method.block_level:
        raise ConfigError(f"{method.name} cannot compress {arch.lm_head}; keep it in --skip")
    _to_compute(head, device)
    stats = None
    if method.stats_class is not None:
        norm = model.get_submodule(arch.final_norm)
        stats = method.stats_class(head.in_features, device)
        for hidden in inputs.hidden:
            stats.add_batch(norm(hidden))
    return _apply(head, method.compress(arch.lm_head, head.weight.data.float(), stats))


def _apply(linear: torch.nn.Linear, res: LinearResult) -> LinearResult:
    if not (res.weight.data_ptr() == linear.weight.data_ptr() and res.weight.shape == linear.weight.shape
            and res.weight.dtype == linear.weight.dtype):  # else it already is the linear's weight (RTN)
        linear.weight.data.copy_(res.weight.to(linear.weight.dtype))
    # Keep results on the CPU: the artifact writer reads them there. On the CPU the result's weight
    # is the linear's own (the same values): one copy of each dense weight, not two.
    if linear.weight.device.type == "cpu" and linear.weight.dtype == res.weight.dtype:
        res.weight = linear.weight.data
    for attr in ("weight", "codes", "scales", "zeros", "perm", "mask"):
        value = getattr(res, attr)
        if value is not None:
            setattr(res, attr, value.cpu())
    if res.fields is not None:
        res.fields = {k: v.cpu() for k, v in res.fields.items()}
    return res


# glibc's mallopt parameters: allocations from M_MMAP_THRESHOLD up get their own mapping, handed
# back to the system when freed (the default adapts upward, to 32 MiB, after each such free); free
# memory at the heap's top beyond M_TRIM_THRESHOLD is handed back at once.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
_TRIM_THRESHOLD_BYTES = 128 << 20


def _libc():
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim, _LIBC.mallopt  # noqa: B018 - glibc only
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


def _bound_heap() -> None:
    """Keep freed memory for reuse within a block, and hand it back after each block (glibc;
    elsewhere nothing), for the block-by-block path.

    A block's fp32 weights and the methods' temporaries are freed when the block is done, but
    glibc keeps allocations under its mmap threshold in its heap, where freed pages stay resident:
    the resident size then grows by about a block per block although nothing is alive. So
    ``_return_freed_memory`` trims the heap after each block. Within a block, though, the same
    activations are allocated and freed once per batch and per pass, and memory that has just been
    handed back costs a page fault per 4 KiB when it is touched again (about 0.3 ms per MB on these
    machines). So the thresholds are fixed at 32 MiB (mmap: glibc's own ceiling, which it would
    otherwise reach by adapting) and 128 MiB (trim: what may stay at the heap's top between the
    per-block trims). An earlier 4 MiB mmap threshold gave every activation a fresh mapping and made
    this path about 20% slower; the price of reuse is some resident memory on small models (at 1-4B a
    batch's activations exceed 32 MiB and get their own mappings anyway). Measured in
    docs/development/notebook.md ("timing what `slmedge compress` does").
    """
    libc = _libc()
    if libc:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)


# A source loaded from safetensors is memory-mapped (transformers 5), one mapping for the whole file,
# which stays until the last tensor viewing it is gone: every page a block's weights were read from
# stays resident (and counts in the peak) until the last block is done, although each block reads
# its weights once, into fp32 memory of its own. On the block-by-block path those pages are handed
# back as each block is read (``MADV_PAGEOUT``: a reclaim hint, never a change of content: a page
# touched again is read again from the file). Qwen2.5-0.5B's shape (bf16), RTN W4 g128: peak RSS
# 2.80 GB without, 2.08 GB with (docs/development/notebook.md, 2026-12-07).
_MADV_PAGEOUT = 21  # Linux 5.4+; elsewhere madvise refuses it and nothing happens


def _source_ranges(module: torch.nn.Module, skip: str | None = None) -> list[tuple[int, int]]:
    """(address, bytes) of ``module``'s CPU tensors (not those whose name starts with ``skip``)."""
    out = []
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        if (skip is None or not name.startswith(skip)) and t.device.type == "cpu" and t.numel():
            out.append((t.data_ptr(), t.numel() * t.element_size()))
    return out


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges where a .safetensors file is mapped into this process (/proc/self/maps)."""
    out = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n").endswith(".safetensors"):
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    out.append((lo, hi))
    except OSError:
        pass
    return out


def _page_out(ranges: list[tuple[int, int]]) -> None:
    """Hand back the resident pages of a mapped .safetensors file that ``ranges`` lie in (whole pages
    inside them; memory of any other kind is left alone)."""
    libc = _libc()
    if not ranges or not libc:
        return
    import ctypes
    import mmap

    maps = _file_mappings()
    if not maps:
        return
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    for ptr, nbytes in ranges:
        for lo, hi in maps:
            start, end = max(ptr, lo), min(ptr + nbytes, hi)
            start, end = -(-start // page) * page, end // page * page
            if end > start:
                libc.madvise(start, end - start, _MADV_PAGEOUT)


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``; a few milliseconds)."""
    libc = _libc()
    if libc:
        libc.malloc_trim(0)


_LIBC = None
