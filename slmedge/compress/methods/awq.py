"""AWQ (Lin et al., 2024): activation-aware scaling, then clipping, then round-to-nearest.

Per block, for each mapping (a norm or linear feeding some linears, see the architecture table):
search s = x_mean^a / w_mean^(1-a) over a grid of a in [0, 1) for the scales whose quantized
weights keep the inspected module's output closest to the original; fold 1/s into the
preceding op and s into the linears (the unquantized function is unchanged); then search a
clipping ratio per output row and group; finally round to nearest on the clipped grid.
The search returns plain data (scales, clip ratios) that is applied in a separate step and
saved with the artifact.
"""

from __future__ import annotations

import torch

from ..blocks import run_block
from ..hooks import linear_inputs, module_calls
from ..quant import QuantSpec, fake_quantize, quantize_groups
from .base import LinearResult, Method, register_method, rtn_result, single_thread


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


def clip_search(w: torch.Tensor, x: torch.Tensor, spec: QuantSpec, n_grid: int = 20, max_shrink: float = 0.5) -> torch.Tensor:
    """Clipping ratio per (row, group) minimising each group's partial output error: (out, G).

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
            q = quantize_groups(wp, spec, clip=ratio)[0]  # codes clamp what lies outside
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

    def compress_block(self, layer, prefix, linears, inputs, layer_index, arch):
        """Search and apply scales and clips for one block; returns ({name: result}, extras)."""
        r = self.recipe
        spec = self.spec
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
        clip_x: dict[str, list[torch.Tensor]] = {n: [] for n in linears}
        calls: dict[str, list[tuple]] = {m.inspect: [] for m in mappings}
        taken = 0

        def on_linear(name, x):
            rel = name[len(prefix) + 1 :]
            flat = x.reshape(-1, x.shape[-1]).float()
            if rel in x_sum:
                total = flat.abs().sum(dim=0)
                x_sum[rel] = total if x_sum[rel] is None else x_sum[rel] + total
                x_count[rel] += flat.shape[0]
            if name in clip_x and taken < max_samples:
                clip_x[name].append(flat[::8])  # every 8th token is plenty for the clip losses

        def on_call(rel, args, kwargs):
            if tokenwise[rel]:
                x = args[0] if args else kwargs["hidden_states"]
                calls[rel].append(((x.reshape(-1, x.shape[-1])[::stride],), {}))
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

        extras = {}
        for m in mappings:
            mods = [layer.get_submodule(n) for n in m.linears]
            prev = layer.get_submodule(m.prev)
            x_mean = x_sum[m.linears[0]] / x_count[m.linears[0]]
            with single_thread():  # 20 small forwards and roundings per mapping: see single_thread
                s = self._search(inspect_mods[m.inspect], calls[m.inspect], mods, x_mean, spec, r.awq_grid)
            fold_scales(prev, mods, s, arch.norm_offset)
            extras[f"{prefix}.{m.prev}.awq_scales"] = s.cpu().float()
            # The captured inputs of the scaled linears shrink by s too.
            for n in m.linears:
                full = f"{prefix}.{n}"
                clip_x[full] = [x / s for x in clip_x[full]]

        results = {}
        for name, lin in linears.items():
            rel = name[len(prefix) + 1 :]
            w = lin.weight.data.float()
            clip = None
            if r.awq_clip and rel not in arch.awq_skip_clip and clip_x[name]:
                x = torch.cat(clip_x[name])[:4096]
                with single_thread():
                    clip = clip_search(w, x, spec)
            res = rtn_result(w, spec, clip=clip)
            lin.weight.data.copy_(res.weight.to(lin.weight.dtype))
            results[name] = LinearResult(res.weight.cpu(), spec, res.codes.cpu(), res.scales.cpu(), res.zeros.cpu())
        return results, extras

    @staticmethod
    def _shapes_fit(layer, mapping) -> bool:
        prev = layer.get_submodule(mapping.prev)
        first = layer.get_submodule(mapping.linears[0])
        if isinstance(prev, torch.nn.Linear):
            return prev.out_features == first.in_features
        return True

    @torch.no_grad()
    def _search(self, module, calls, linears, x_mean, spec, n_grid) -> torch.Tensor:
        originals = [lin.weight.data.clone() for lin in linears]
        reference = [_first(module(*a, **k)) for a, k in calls]
        w_mean = weight_mean(originals, spec)
        best, best_loss = None, float("inf")
        try:
            for i in range(n_grid):
                alpha = i / n_grid
                s = awq_scales(x_mean, w_mean, alpha)
                for lin, w in zip(linears, originals):
                    lin.weight.data.copy_(fake_quantize(w * s.view(1, -1), spec) / s.view(1, -1))
                loss = sum(float((_first(module(*a, **k)) - ref).float().pow(2).sum()) for (a, k), ref in zip(calls, reference))
                if loss < best_loss:
                    best, best_loss = s, loss
        finally:
            for lin, w in zip(linears, originals):
                lin.weight.data.copy_(w)
        return best


def _first_samples(args: tuple, kwargs: dict, keep: int, batch: int):
    """The first ``keep`` samples of a captured call: tensors whose leading dim is the batch."""
    if keep >= batch:
        return args, kwargs

    def cut(v):
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == batch:
            return v[:keep]
        if isinstance(v, tuple):
            return tuple(cut(x) for x in v)
        return v

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def _first(out):
    return out[0] if isinstance(out, tuple) else out
