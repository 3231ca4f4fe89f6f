"""AWQ (Lin et al., 2024): activation-aware scaling, then clipping, then round-to-nearest.

Per block, for each mapping (a norm or linear feeding some linears, see the architecture table):
search s = x_mean^a / w_mean^(1-a) over a grid of a in [0, 1) for the scales whose quantized
weights keep the inspected module's output closest to the original; fold 1/s into the
preceding op and s into the linears (the unquantized function is unchanged); then search a
clipping ratio per output row and group; finally round to nearest on the clipped grid.
The search returns plain data (scales, clip ratios) that is applied in a separate step and
saved with the artifact.

The scale search's forwards only rank grid points; they multiply in the recipe's
``awq_search_dtype`` (bf16 where the device has it natively, see ``search_dtype`` and
``LinearsIn``), as AutoAWQ's and llm-compressor's run in the model's half dtype. Everything that
ends up in the weights (activation means, scales, clip ratios, rounding) is fp32.
"""

from __future__ import annotations

import functools

import torch

from ..blocks import run_block
from ..hooks import linear_inputs, module_calls
from ..quant import QuantSpec, fake_quantize, fake_quantize_any, quantize_groups  # noqa: F401 - fake_quantize, quantize_groups re-exported
from .base import LinearResult, Method, register_method, rtn_result, single_thread


def search_dtype(setting: str, device) -> torch.dtype:
    """The recipe's ``awq_search_dtype`` on ``device``: "auto" is bfloat16 where the device
    multiplies bf16 natively (CUDA with bf16; x86 CPUs with AVX512-BF16 or AMX through oneDNN),
    float32 elsewhere, where bf16 matmuls are emulated and slower than fp32 ones."""
    if setting in ("float32", "bfloat16"):
        return getattr(torch, setting)
    return torch.bfloat16 if native_bf16(torch.device(device)) else torch.float32


def native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        try:
            return torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # an older torch without the argument
            return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                    and _cpu_flags() & {"avx512_bf16", "amx_bf16"})
    return False


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none: bf16 stays off)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def awq_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    s = (x_mean.pow(alpha) / w_mean.pow(1 - alpha).clamp(min=1e-4)).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def weight_mean(weights: list[torch.Tensor], spec: QuantSpec) -> torch.Tensor:
    """Mean over output rows of |W| normalised by each group's max: (in,)."""
    w = torch.cat(weights, dim=0).abs()
    cols = w.shape[1]
    g = spec.group_width(cols)
    normed = torch.empty_like(w)
    for start in range(0, cols, g):
        block = w[:, start : start + g]
        normed[:, start : start + g] = block / block.amax(dim=1, keepdim=True).clamp(min=1e-8)
    return normed.mean(dim=0)


def fold_scales(prev: torch.nn.Module, linears: list[torch.nn.Linear], s: torch.Tensor, norm_offset: float) -> None:
    """Divide ``prev``'s output by s and multiply the linears' inputs by s (function unchanged)."""
    if isinstance(prev, torch.nn.Linear):
        prev.weight.data.div_(s.view(-1, 1))
        if prev.bias is not None:
            prev.bias.data.div_(s)
    else:  # an RMSNorm: y = norm(x) * (offset + w)
        w = prev.weight.data
        w.copy_((w.float() + norm_offset) / s - norm_offset)
        if getattr(prev, "bias", None) is not None:
            prev.bias.data.div_(s)
    for lin in linears:
        lin.weight.data.mul_(s.view(1, -1))


def clip_search(w: torch.Tensor, x: torch.Tensor, spec, n_grid: int = 20, max_shrink: float = 0.5,
                importance: torch.Tensor | None = None) -> torch.Tensor:
    """Clipping ratio per (row, group) minimising each group's partial output error: (out, G).

    ``spec``: the uniform grid (groups of its group size) or a llama.cpp grid (groups: its sub-blocks,
    each candidate ratio shrinking the range its scale search starts from; ``importance`` weighs
    that search, ``compress.grid_fit``).

    ``x`` is (tokens, in), a subsample of the layer's inputs. The error of a group's clipped
    weights ``q`` is ``mean_t (x_t . (q - w))^2`` per row, the same quantity as the reference's
    ``(x @ q.T - x @ w.T)^2`` averaged over tokens, computed as ``d G d^T`` with ``d = q - w``
    and ``G = x^T x / tokens`` the group's input Gram matrix: ``tokens / g`` times fewer
    multiply-adds (64x at 4,096 tokens, g64), every group at once. The floats differ from the
    token-by-token sum in the last bits (and are closer to the exact value: no difference of two
    large products), so a ratio can change where two ratios' errors agree to ~1e-7.
    """
    rows, cols = w.shape
    g = spec.group_width(cols)
    n_groups = spec.num_groups(cols)
    tokens = x.shape[0]
    x = x.float()
    best_ratio = torch.ones(rows, n_groups, device=w.device)
    full = cols // g
    parts = [(0, full, g)] + ([(full * g, 1, cols - full * g)] if cols % g else [])
    for start, count, width in parts:
        wp = w[:, start : start + count * width].float()
        xp = x[:, start : start + count * width].reshape(tokens, count, width).transpose(0, 1)  # (G, t, g)
        gram = torch.bmm(xp.transpose(1, 2), xp) / tokens  # (G, g, g)
        best_err = torch.full((count, rows), float("inf"), device=w.device)
        best = torch.ones(count, rows, device=w.device)
        for i in range(int(max_shrink * n_grid)):
            ratio = 1 - i / n_grid
            # codes clamp what lies outside; on a llama.cpp grid a quick search ranks the ratios
            q = fake_quantize_any(wp, spec, clip=ratio, importance=importance, quick=True)
            d = (q - wp).reshape(rows, count, width).transpose(0, 1)  # (G, rows, g)
            err = (torch.bmm(d, gram) * d).sum(dim=2)  # (G, rows)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, torch.full_like(best, ratio), best)
        best_ratio[:, start // g : start // g + count] = best.t()
    return best_ratio


@register_method("awq")
class AWQ(Method):
    kind = "quantize"
    summary = "AWQ: activation-aware scaling and clipping, folded into the preceding norm or linear"
    block_level = True  # scales are searched per block and folded into the op before: no per-linear statistics
    settings = ("awq_grid", "awq_clip", "awq_max_tokens", "awq_search_dtype")

    def __init__(self, recipe):
        super().__init__(recipe)
        self.search_dtype: torch.dtype | None = None  # set by resolve(), else by the first block

    def resolve(self, device):
        self.search_dtype = search_dtype(self.recipe.awq_search_dtype, device)
        return {"awq_search_dtype": str(self.search_dtype).removeprefix("torch.")}

    def compress_block(self, layer, prefix, linears, inputs, layer_index, arch):
        """Search and apply scales and clips for one block; returns ({name: result}, extras)."""
        r = self.recipe
        mappings = [m for m in arch.awq if all(f"{prefix}.{n}" in linears for n in m.linears)]
        mappings = [m for m in mappings if self._shapes_fit(layer, m)]
        # The search losses use about awq_max_tokens tokens: the first whole samples for
        # attention (calibration windows are already random), every stride-th token of all
        # samples for token-wise modules (MLPs, linears).
        seqlen = inputs.hidden[0].shape[1]
        total = sum(h.shape[0] for h in inputs.hidden) * seqlen
        max_samples = max(1, r.awq_max_tokens // seqlen)
        stride = max(1, -(-total // r.awq_max_tokens))
        tokenwise = {m.inspect: m.tokenwise for m in mappings}

        # One pass with the original weights: per-channel mean |x| of each mapping's input (all
        # tokens), and the inspected modules' inputs for the search subset.
        x_sum = {m.linears[0]: None for m in mappings}
        x_count = {m.linears[0]: 0 for m in mappings}
        # Each linear's input mean squares (the grid's importance), over all tokens.
        x_sq: dict[str, torch.Tensor] = {}
        x_sq_count: dict[str, int] = {}
        clip_x: dict[str, list[torch.Tensor]] = {n: [] for n in linears}
        calls: dict[str, list[tuple]] = {m.inspect: [] for m in mappings}
        capacity = sum(-(-h.shape[0] * seqlen // stride) for h in inputs.hidden)
        rows = {m.inspect: _Rows(stride, capacity) for m in mappings if m.tokenwise}
        taken = 0

        def on_linear(name, x):
            rel = name[len(prefix) + 1 :]
            flat = x.reshape(-1, x.shape[-1]).float()
            if rel in x_sum:
                total = flat.abs().sum(dim=0)
                x_sum[rel] = total if x_sum[rel] is None else x_sum[rel] + total
                x_count[rel] += flat.shape[0]
            if self.on_grid:
                sq = flat.pow(2).sum(dim=0)
                x_sq[name] = sq if name not in x_sq else x_sq[name] + sq
                x_sq_count[name] = x_sq_count.get(name, 0) + flat.shape[0]
            if name in clip_x and taken < max_samples:
                # Every 8th token is plenty for the clip losses. Copied: a strided view would keep
                # the whole activation alive (``_own``).
                clip_x[name].append(_own(flat[::8]))

        def on_call(rel, args, kwargs):
            if tokenwise[rel]:
                x = args[0] if args else kwargs["hidden_states"]
                calls[rel].append(((rows[rel].take(x.reshape(-1, x.shape[-1])),), {}))
            elif taken < max_samples:
                keep = max_samples - taken  # whole samples only, cut at the batch dimension
                calls[rel].append(_first_samples(args, kwargs, keep, args[0].shape[0] if args else kwargs["hidden_states"].shape[0]))

        named = {f"{prefix}.{rel}": layer.get_submodule(rel) for m in mappings for rel in m.linears}
        named.update(linears)
        inspect_mods = {m.inspect: layer.get_submodule(m.inspect) for m in mappings}
        with linear_inputs(named, on_linear), module_calls(inspect_mods, on_call):
            for hidden in inputs.hidden:
                run_block(layer, hidden, inputs.kwargs(layer_index, hidden))
                taken += hidden.shape[0]

        specs = {name: self.spec_for(name, mod.in_features) for name, mod in named.items()}
        importance = {name: x_sq[name] / x_sq_count[name] for name in x_sq} if self.weighs else {}
        extras = {}
        if self.search_dtype is None:
            self.resolve(layer.get_submodule(mappings[0].prev).weight.device if mappings else "cpu")
        dtype = self.search_dtype
        for m in mappings:
            mods = [layer.get_submodule(n) for n in m.linears]
            prev = layer.get_submodule(m.prev)
            x_mean = x_sum[m.linears[0]] / x_count[m.linears[0]]
            full_names = [f"{prefix}.{n}" for n in m.linears]
            grids = [specs[n] for n in full_names]
            imps = [importance.get(n) for n in full_names]
            with single_thread():  # 20 small forwards and roundings per mapping: see single_thread
                s = self._search(inspect_mods[m.inspect], calls[m.inspect], mods, x_mean, grids, r.awq_grid, dtype,
                                 imps)
            fold_scales(prev, mods, s, arch.norm_offset)
            extras[f"{prefix}.{m.prev}.awq_scales"] = s.cpu().float()
            # The captured inputs of the scaled linears shrink by s too (their mean squares by s^2).
            for full in full_names:
                clip_x[full] = [x / s for x in clip_x[full]]
                if full in importance:
                    importance[full] = importance[full] / s.pow(2)

        results = {}
        for name, lin in linears.items():
            rel = name[len(prefix) + 1 :]
            w = lin.weight.data.float()
            spec, imp = specs[name], importance.get(name)
            clip = None
            if r.awq_clip and rel not in arch.awq_skip_clip and clip_x[name]:
                x = torch.cat(clip_x[name])[:4096]
                with single_thread():
                    clip = clip_search(w, x, spec, importance=imp)
            res = rtn_result(w, spec, clip=clip, importance=imp)
            lin.weight.data.copy_(res.weight.to(lin.weight.dtype))

            def cpu(t):
                return None if t is None else t.cpu()

            results[name] = LinearResult(res.weight.cpu(), spec, res.codes.cpu(), cpu(res.scales), cpu(res.zeros),
                                         fields=None if res.fields is None else {k: v.cpu() for k, v in res.fields.items()})
        return results, extras

    @staticmethod
    def _shapes_fit(layer, mapping) -> bool:
        prev = layer.get_submodule(mapping.prev)
        first = layer.get_submodule(mapping.linears[0])
        if isinstance(prev, torch.nn.Linear):
            return prev.out_features == first.in_features
        return True

    @property
    def on_grid(self) -> bool:
        return self.recipe.on_grid

    @property
    def weighs(self) -> bool:
        """Whether the grid's scale search weighs by the captured activations (llama.cpp grids only)."""
        return self.recipe.on_grid and self.recipe.importance is not False

    @torch.no_grad()
    def _search(self, module, calls, linears, x_mean, spec, n_grid, dtype=torch.float32, importance=None) -> torch.Tensor:
        """The grid point whose quantized linears keep ``module``'s output closest to its own.

        In a half ``dtype`` the whole grid is ranked there. fp32 then takes the loss of the best
        point, which measures how far off the half-precision losses are here (``r``, relative),
        and decides among the points within ``max(REFINE_MARGIN, REFINE_NOISE * r)`` of the best:
        the result is the fp32 search's wherever its best point is among them (all 180 of
        SmolLM2's mappings at W4 g64 and g32), at about a quarter of its fp32 forwards.
        """
        points = list(range(n_grid))
        losses, scales = grid_losses(module, calls, linears, x_mean, spec, n_grid, dtype, points,
                                      importance=importance)
        if dtype != torch.float32:
            low = _best(losses)
            if low is None:  # nothing finite in half precision: the whole grid in fp32
                losses, scales = grid_losses(module, calls, linears, x_mean, spec, n_grid, torch.float32, points,
                                              importance=importance)
            else:
                reference = module_outputs(module, calls, torch.float32)
                exact = grid_losses(module, calls, linears, x_mean, spec, n_grid, torch.float32, [low], reference,
                                    importance=importance)[0][0]
                off = abs(losses[low] - exact) / exact if exact > 0 else (0.0 if losses[low] == exact else float("inf"))
                bound = losses[low] * (1 + max(REFINE_MARGIN, REFINE_NOISE * off))
                near = [i for i in points if i != low and losses[i] <= bound]
                found = dict(zip(near, zip(*grid_losses(module, calls, linears, x_mean, spec, n_grid, torch.float32,
                                                        near, reference, importance=importance)))) if near else {}
                found[low] = (exact, scales[low])
                points = sorted(found)
                losses, scales = [found[i][0] for i in points], [found[i][1] for i in points]
        best = _best(losses)
        if best is None:
            raise FloatingPointError(f"AWQ's scale search found no finite loss for {type(module).__name__} "
                                     f"(the calibration activations overflow or are NaN)")
        return scales[best]


# A half-precision search hands fp32 the grid points whose losses are within
# max(REFINE_MARGIN, REFINE_NOISE * r) of its best, r being how far (relative) its loss of that
# point is from fp32's. Measured on SmolLM2 along fp32's path (`git show 5f8f6c1:scripts/bench/awq_search_dtype.py`):
# at W4 g64 a fixed 2% kept fp32's best point in all 90 mappings, but at g32 it missed 3 (one
# choice 81% above fp32's best loss, in block 11, whose massive activations bf16 rounds coarsely);
# with the noise term (5 r) none of the 180 is missed, at 4.0-4.8 candidates per mapping.
REFINE_MARGIN = 0.02
REFINE_NOISE = 5.0


def _best(losses: list[float]) -> int | None:
    """Index of the first smallest loss; NaNs never win; None if no loss is finite."""
    best, best_loss = None, float("inf")
    for i, loss in enumerate(losses):
        if loss < best_loss:
            best, best_loss = i, loss
    return best


@torch.no_grad()
def module_outputs(module, calls, dtype=torch.float32) -> list[torch.Tensor]:
    """``module``'s outputs on the captured ``calls``, its linears and attention in ``dtype``."""
    with LinearsIn(module, dtype):
        return [_first(module(*a, **k)) for a, k in calls]


@torch.no_grad()
def grid_losses(module, calls, linears, x_mean, spec, n_grid, dtype=torch.float32, points=None,
                reference=None, importance=None) -> tuple[list[float], list[torch.Tensor]]:
    """For each grid point ``i`` of ``points`` (default: all ``n_grid``), ``a = i / n_grid``: the
    summed squared difference of ``module``'s outputs on ``calls`` with ``linears`` scaled by
    ``s = awq_scales(x_mean, w_mean, a)`` and quantized, from its outputs with the original
    weights; and the scales.

    ``dtype``: what the module's linears and attention multiply in while the outputs are taken,
    the reference's and the grid's alike (``LinearsIn``); the scales and the quantization are fp32
    whatever it is. ``reference``: the original outputs, already computed in ``dtype``
    (``module_outputs``). The weights are restored on return.

    ``spec``: one grid for every linear, or a list of one per linear (a budget may give them
    different ones); ``importance``: None or a list of each linear's input mean squares (a llama.cpp
    grid's scale search weighs by them, divided by s^2 as the scaled linear's inputs are x / s).
    """
    points = range(n_grid) if points is None else points
    specs = list(spec) if isinstance(spec, (list, tuple)) else [spec] * len(linears)
    imps = list(importance) if importance is not None else [None] * len(linears)
    originals = [lin.weight.data.clone() for lin in linears]
    w_mean = weight_mean(originals, specs[0])
    losses, scales = [], []
    with LinearsIn(module, dtype) as run:
        try:
            if reference is None:
                reference = [_first(module(*a, **k)) for a, k in calls]
            for i in points:
                s = awq_scales(x_mean, w_mean, i / n_grid)
                for lin, w, sp, imp in zip(linears, originals, specs, imps):
                    scaled_imp = None if imp is None else imp / s.pow(2)
                    # (on a llama.cpp grid a quick scale search ranks the points: the kept codes get a full one)
                    run.set_weight(lin, fake_quantize_any(w * s.view(1, -1), sp, importance=scaled_imp, quick=True)
                                   / s.view(1, -1))
                losses.append(sum(float((_first(module(*a, **k)) - ref).float().pow(2).sum()) for (a, k), ref in zip(calls, reference)))
                scales.append(s)
        finally:
            for lin, w in zip(linears, originals):
                lin.weight.data.copy_(w)
    return losses, scales


class LinearsIn:
    """Within the block, ``module``'s linears (or ``module`` itself) and its SDPA attention compute in ``dtype``.

    Inputs and weights are rounded to ``dtype``, the products accumulate in fp32 (oneDNN's and
    cuBLAS's bf16 matmuls, torch's bf16 attention kernels), the outputs go back to the input's
    dtype: norms, rotary embeddings, softmax inputs' masks and activations stay fp32. In fp32 the
    module is left as it is and ``set_weight`` writes the weight in place. Everything is restored
    on exit.
    """

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        self.low = dtype != torch.float32
        self.linears = [module] if isinstance(module, torch.nn.Linear) else [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
        self.weights: dict[int, torch.Tensor] = {}
        config = getattr(module, "config", None)
        self.attention = getattr(config, "_attn_implementation", None) if self.low else None
        self._saved_attention = None

    def __enter__(self) -> "LinearsIn":
        if self.low:
            for lin in self.linears:
                self.weights[id(lin)] = lin.weight.data.to(self.dtype)
                lin.forward = functools.partial(self._forward, lin)  # the instance's, over the class's
            if self.attention == "sdpa":
                from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as fns

                self._saved_attention = fns._local_mapping.get("sdpa")
                fns["sdpa"] = functools.partial(_attention_in, fns["sdpa"], self.dtype)
        return self

    def __exit__(self, *exc) -> None:
        if self.low:
            for lin in self.linears:
                del lin.forward
            self.weights.clear()
            if self.attention == "sdpa":
                from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as fns

                del fns["sdpa"]
                if self._saved_attention is not None:
                    fns["sdpa"] = self._saved_attention

    def set_weight(self, lin: torch.nn.Linear, weight: torch.Tensor) -> None:
        if self.low:
            self.weights[id(lin)] = weight.to(self.dtype)
        else:
            lin.weight.data.copy_(weight)

    def _forward(self, lin: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        bias = None if lin.bias is None else lin.bias.to(self.dtype)
        return torch.nn.functional.linear(x.to(self.dtype), self.weights[id(lin)], bias).to(x.dtype)


def _attention_in(attend, dtype, module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention on q/k/v (and a float mask) rounded to ``dtype``; output in q's dtype."""
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.to(dtype)
    out, weights = attend(module, query.to(dtype), key.to(dtype), value.to(dtype), attention_mask, **kwargs)
    return out.to(query.dtype), weights


class _Rows:
    """Every ``stride``-th row of each batch's (tokens, width) input, copied into one buffer.

    The search keeps these rows of every calibration batch until the block is done. Kept as views
    (``x[::stride]``), they kept each batch's whole input alive: every MLP input and down_proj
    input of the calibration set. Copied one by one, each small copy was carved out of the heap
    space a batch's activations had just freed, so the next batch's activations needed fresh
    space: the resident size grew by about one down_proj input per batch all the same (glibc's
    heap, below its mmap threshold; measured, see docs/development/notebook.md). One buffer for all
    batches, allocated at the first, leaves nothing between them. The values are the same rows, so
    the results are the same bits.
    """

    def __init__(self, stride: int, capacity: int):
        self.stride, self.capacity = stride, capacity
        self.buffer: torch.Tensor | None = None
        self.used = 0

    def take(self, x: torch.Tensor) -> torch.Tensor:
        n = -(-x.shape[0] // self.stride)
        if self.buffer is None:
            self.buffer = torch.empty(self.capacity, x.shape[1], dtype=x.dtype, device=x.device)
        if self.used + n > self.capacity or self.buffer.shape[1:] != x.shape[1:] or self.buffer.dtype != x.dtype:
            return _own(x[:: self.stride])  # more calls than batches (a module run twice): a copy of its own
        out = self.buffer[self.used : self.used + n]
        out.copy_(x[:: self.stride])
        self.used += n
        return out


def _own(x: torch.Tensor) -> torch.Tensor:
    """``x`` in storage of its own size: a subsample taken as a view (every k-th token, the first
    samples) would keep the whole tensor it was cut from alive for the block's search."""
    return x if x.untyped_storage().nbytes() <= x.numel() * x.element_size() else x.clone(memory_format=torch.contiguous_format)


def _first_samples(args: tuple, kwargs: dict, keep: int, batch: int):
    """The first ``keep`` samples of a captured call: tensors whose leading dim is the batch."""
    if keep >= batch:
        return args, kwargs

    def cut(v):
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch:
            return _own(v[:keep])
        if isinstance(v, tuple):
            return tuple(cut(x) for x in v)
        return v

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def _first(out):
    return out[0] if isinstance(out, tuple) else out
