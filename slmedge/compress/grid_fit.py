"""Scales chosen by importance: the search that fits a llama.cpp grid (``models.grids``) to a weight.

For every (sub-)block the scale (and min) is searched to minimise the weighted squared error
``sum_j wt_j (w_j - A T[q_j] - B)^2`` of its weights, as llama.cpp's quantizers do with an
importance matrix (ggml-quants.c: ``make_qx_quants``, ``make_qkx3_quants``, ``make_qp_quants``,
``quantize_row_iq4_nl_impl``, called with ``quant_weights``). Each weight's ``wt`` comes from the
calibration statistics the engine collects, the mean square of the input channel it multiplies
(``importance``: an importance matrix's row, diag(H)/2 for GPTQ), combined with the weight as
llama.cpp combines them per type (``Grid.weighting``); without statistics a data-free weighting
(``Grid.data_free``) stands in.

What differs from llama.cpp, and why: candidates are ranked as llama.cpp ranks them (each with its
own codes) but after rounding to fp16, and the two best, with the plain min/max (or max-magnitude)
scale, are judged by the error they actually give with every code re-chosen for the stored scale;
so the search never does worse than min/max rounding on the weighted error; the min of Q4_1/Q5_1 is free (llama.cpp's imatrix path forces it to be <= 0), so a
weight already on a Q4_1 grid is found again exactly; and the sub-block scale codes of the
super-block types are fitted with each sub-block's curvature ``sum wt T^2`` (llama.cpp: ``sum wt``).

All in fp32, vectorised over every block of a weight; deterministic (no randomness, and the same
operations in the same order whatever the thread count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.grids import Grid, decode, effective, levels_tensor

EPS = 1e-15  # llama.cpp's GROUP_MAX_EPS: a block whose largest magnitude is below it is all zeros


@dataclass
class GridFit:
    """A fitted weight: its codes (uint8, (rows, cols)), the fields an artifact keeps (fp16 ``d``,
    ``m``/``dmin``; uint8 ``sc``/``mc``), and the dequantized weight (fp32, ``decode`` of both)."""

    codes: torch.Tensor
    fields: dict
    weight: torch.Tensor


def element_weights(grid: Grid, w: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """(rows, cols) weight of each element in the search: llama.cpp's ``quant_weights`` formula of the
    grid's type with the input channels' mean squares ``importance`` (cols,), else its data-free one."""
    rows, cols = w.shape
    sq = w * w
    if importance is not None:
        qw = importance.float().reshape(1, cols)
        if grid.weighting == "plain":
            return qw.expand(rows, cols).contiguous()
        sigma2 = _sigma2(grid, sq)
        return (sigma2 + sq).sqrt_().mul_(qw)
    if grid.data_free == "one":
        return torch.ones_like(w)
    if grid.data_free == "square":
        return sq
    return _sigma2(grid, sq).sqrt_().add_(w.abs())  # "avabs": sqrt(sigma2) + |x|


def _sigma2(grid: Grid, sq: torch.Tensor) -> torch.Tensor:
    """llama.cpp's sigma2 per element's scope: the row's mean square ("row"), or twice the super-block's."""
    rows, cols = sq.shape
    if grid.weighting == "row":
        return sq.sum(dim=1, keepdim=True) / cols
    per_block = sq.view(rows, cols // grid.block, grid.block).sum(dim=2) * (2.0 / grid.block)
    return per_block.repeat_interleave(grid.block, dim=1)


def fit(grid: Grid, w: torch.Tensor, importance: torch.Tensor | None = None, clip=None, quick: bool = False) -> GridFit:
    """Codes and scales of ``w`` (rows, cols) on ``grid``.

    ``importance``: (cols,) mean square of each input channel over calibration tokens (None: the
    data-free search). ``clip``: None, a scalar or (rows, cols // grid.sub) ratios in (0, 1] that
    shrink each sub-block's range before the search (AWQ's clip search). ``quick``: a quarter of the
    candidates (AWQ ranks its scale and clip candidates with it; what is kept is a full search's)."""
    w = w.float()
    rows, cols = w.shape
    if cols % grid.block:
        raise ValueError(f"{grid.name} needs rows divisible by {grid.block}, got {cols} (grids.grid_for_width)")
    wt = element_weights(grid, w, importance)
    n_sub = cols // grid.sub
    x = w.reshape(rows * n_sub, grid.sub)
    wts = wt.reshape(rows * n_sub, grid.sub)
    clip = _clip(clip, rows, n_sub)
    direct = not grid.sub_bits
    if grid.search == "sym":
        nmax = -grid.levels[0]
        scale, curv = search_sym(x, wts, nmax, clip, fp16=direct, quick=quick)
        mins = None
    elif grid.search == "asym":
        scale, mins, curv = search_asym(x, wts, grid.levels[-1], clip, fp16=direct, free_min=direct, quick=quick)
    elif grid.search == "table":
        scale, curv = search_table(x, wts, levels_tensor(grid, w.device), clip, fp16=direct, quick=quick)
        mins = None
    else:
        raise ValueError(f"grid {grid.name}: no search named {grid.search!r}")
    fields = (_direct_fields(grid, scale, mins, rows) if direct else
              _super_fields(grid, scale.view(rows, n_sub), None if mins is None else (-mins).view(rows, n_sub),
                            curv.view(rows, n_sub), wts.sum(dim=1).view(rows, n_sub)))
    A, B = effective(grid, fields, rows, cols)
    codes = nearest_codes(grid, w.view(rows, n_sub, grid.sub), A[:, :, None], None if B is None else B[:, :, None])
    codes = codes.view(rows, cols)
    return GridFit(codes, fields, decode(grid, codes, fields))


def _clip(clip, rows: int, n_sub: int):
    if clip is None:
        return None
    if isinstance(clip, torch.Tensor):
        return clip.float().reshape(rows * n_sub) if clip.dim() else float(clip)
    return float(clip)


def _direct_fields(grid: Grid, scale, mins, rows: int) -> dict:
    fields = {"d": scale.view(rows, -1).half()}
    if grid.min:
        fields["m"] = mins.view(rows, -1).half()
    return fields


def _super_fields(grid: Grid, scale, mins, curv, sw) -> dict:
    """A super-block's fp16 scale (and min scale) and its sub-blocks' integer codes, from the
    sub-blocks' continuous scales (and mins, as the amounts subtracted: >= 0): ``make_qp_quants`` (6-bit unsigned, K-quants with mins)
    or a symmetric search (signed codes: Q3_K, Q6_K, IQ4_XS), each sub-block weighted by its
    curvature (``sum wt T^2``; ``sum wt`` for the mins)."""
    rows, n_sub = scale.shape
    per = grid.block // grid.sub
    nsb = n_sub // per
    s = scale.reshape(rows * nsb, per)
    c = curv.reshape(rows * nsb, per)
    if grid.min:
        d, sc = make_qp(s.clamp(min=0), 2**grid.sub_bits - 1, c)
        dmin, mc = make_qp(mins.reshape(rows * nsb, per).clamp(min=0), 2**grid.sub_bits - 1, sw.reshape(rows * nsb, per))
        # The codes were chosen for the fp32 scales: re-chosen for the fp16 ones the block stores.
        d16, dmin16 = d.half(), dmin.half()
        sc = _requantize_codes(s, d16, 2**grid.sub_bits - 1)
        mc = _requantize_codes(mins.reshape(rows * nsb, per), dmin16, 2**grid.sub_bits - 1)
        return {"d": d16.view(rows, nsb), "dmin": dmin16.view(rows, nsb), "sc": sc.view(rows, n_sub).to(torch.uint8),
                "mc": mc.view(rows, n_sub).to(torch.uint8)}
    nmax = 2 ** (grid.sub_bits - 1)
    d, _ = search_sym(s, c, nmax, None, fp16=True)
    safe = torch.where(d == 0, torch.ones_like(d), d.float())
    codes = (s / safe[:, None]).round_().clamp_(-nmax, nmax - 1)
    codes = torch.where((d == 0)[:, None], torch.zeros_like(codes), codes) + grid.sub_offset
    return {"d": d.half().view(rows, nsb), "sc": codes.view(rows, n_sub).to(torch.uint8)}


def _requantize_codes(x, d16, nmax: int):
    d = d16.float()
    safe = torch.where(d == 0, torch.ones_like(d), d)
    codes = (x / safe[:, None]).round_().clamp_(0, nmax)
    return torch.where((d == 0)[:, None], torch.zeros_like(codes), codes)


# --- codes for given scales -----------------------------------------------------------------------


def nearest_codes(grid: Grid, w: torch.Tensor, A: torch.Tensor, B: torch.Tensor | None) -> torch.Tensor:
    """The code of the level nearest each weight of ``w`` under broadcastable scales ``A`` and offsets
    ``B`` (uint8). Where ``A`` is 0 every code decodes alike; the one of the level nearest zero is taken."""
    zero_code = int(torch.tensor(grid.levels).abs().argmin())
    dead = A == 0
    safe = torch.where(dead, torch.ones_like(A), A)
    t = (w - B) if B is not None else w
    t = t / safe
    if grid.uniform:
        lo = grid.levels[0]
        codes = t.round_().sub_(lo).clamp_(0, len(grid.levels) - 1)
    else:
        codes = torch.bucketize(t, table_midpoints(grid, t.device)).float()
    codes = torch.where(dead, torch.full_like(codes, zero_code), codes)
    return codes.to(torch.uint8)


def table_midpoints(grid: Grid, device=None) -> torch.Tensor:
    """Midpoints between consecutive levels (ascending): ``bucketize`` against them is the nearest level."""
    T = levels_tensor(grid, device)
    return (T[1:] + T[:-1]) / 2


# --- the searches, vectorised over blocks (rows of x) -----------------------------------------------


def _signed_max(x: torch.Tensor):
    """(largest |x|, the value holding it, sign kept) per row; the first on ties, as llama.cpp's loop."""
    amax, idx = x.abs().max(dim=1)
    return amax, x.gather(1, idx[:, None]).squeeze(1)


def _safe_div(num: torch.Tensor, den: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), fallback)


class _Finalists:
    """The candidates of a search, ranked per row by an error computed from running sums (each with its
    own codes, as llama.cpp judges them); the best ``keep`` of them are then judged exactly (every code
    re-chosen for the rounded scale) with the always-exact plain candidate, and the least error wins."""

    def __init__(self, rows: int, width: int, keep: int = 2, like: torch.Tensor | None = None):
        self.err = torch.full((keep, rows), float("inf"), dtype=like.dtype, device=like.device)
        self.vals = torch.zeros((keep, width, rows), dtype=like.dtype, device=like.device)

    def offer(self, err: torch.Tensor, *vals: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Offer one candidate per row; returns where it is the best so far."""
        if valid is not None:
            err = torch.where(valid, err, torch.full_like(err, float("inf")))
        v = torch.stack(vals)
        best_before = self.err[0].clone()
        for k in range(self.err.shape[0]):  # insertion into the sorted list of finalists
            better = err < self.err[k]
            old_err, old_v = self.err[k].clone(), self.vals[k].clone()
            self.err[k] = torch.where(better, err, self.err[k])
            self.vals[k] = torch.where(better, v, self.vals[k])
            err = torch.where(better, old_err, err)
            v = torch.where(better, old_v, v)
        return self.err[0] < best_before


def search_sym(x: torch.Tensor, wt: torch.Tensor, nmax: int, clip=None, fp16: bool = False, quick: bool = False):
    """Scale per row of ``x`` (N, n) for codes in [-nmax, nmax-1]: ``make_qx_quants`` (rmse_type 1 with
    ``quant_weights``): candidates ``iscale = -(nmax + 0.1 k) / max`` for k in -9..9 (``quick``: -6..6 by
    3), each refined by weighted least squares; plus the plain ``max / -nmax``. With ``fp16`` each
    candidate is rounded to fp16 before it is judged. Returns (scale, curvature ``sum wt L^2`` of the
    chosen codes)."""
    amax, maxv = _signed_max(x)
    if clip is not None:
        maxv = maxv * clip
    dead = amax < EPS
    maxv = torch.where(dead | (maxv == 0), torch.ones_like(maxv), maxv)
    wx = wt * x
    sxx = (wx * x).sum(dim=1)
    finalists = _Finalists(x.shape[0], 1, like=x)
    for k in ([0, -6, -3, 3, 6] if quick else [0] + [k for k in range(-9, 10) if k]):
        iscale = -(nmax + 0.1 * k) / maxv
        L = (x * iscale[:, None]).round_().clamp_(-nmax, nmax - 1)
        sumlx = (wx * L).sum(dim=1)
        suml2 = (wt * L * L).sum(dim=1)
        scale = _safe_div(sumlx, suml2, 1 / iscale)
        if fp16:
            scale = scale.half().float()
        finalists.offer(sxx - 2 * scale * sumlx + scale * scale * suml2, scale)
    plain = maxv / -nmax
    candidates = [plain.half().float() if fp16 else plain] + [finalists.vals[i, 0] for i in range(finalists.vals.shape[0])]
    return _best_of(candidates, lambda scale: _sym_error(x, wt, scale, nmax), amax, dead)


def _best_of(candidates, error, amax, dead):
    """Per block, the candidate scale with the least weighted error (``error(scale)`` -> (error,
    curvature)), the first on ties; 0 for all-zero blocks. Returns (scale, curvature)."""
    best_err = torch.full_like(amax, float("inf"))
    best, best_curv = torch.zeros_like(amax), torch.zeros_like(amax)
    for scale in candidates:
        err, curv = error(scale)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, scale, best)
        best_curv = torch.where(better, curv, best_curv)
    best = torch.where(dead, torch.zeros_like(best), best)
    return best, best_curv


def _sym_error(x, wt, scale, nmax: int):
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)[:, None]
    L = (x / safe).round_().clamp_(-nmax, nmax - 1)
    L = torch.where(scale[:, None] == 0, torch.zeros_like(L), L)
    diff = x - scale[:, None] * L
    return (wt * diff * diff).sum(dim=1), (wt * L * L).sum(dim=1)


def search_asym(x: torch.Tensor, wt: torch.Tensor, nmax: int, clip=None, fp16: bool = False, free_min: bool = False,
                quick: bool = False):
    """Scale and min per row of ``x`` (N, n) for ``x = scale*L + min`` with codes in [0, nmax]:
    ``make_qkx3_quants`` (rmin -0.9, rdelta 0.05, 36 steps, weighted least squares for both; a step that
    wins moves the min the next start from; ``quick``: every 9th step), plus the plain min/max pair.
    ``free_min``: the min may be positive (Q4_1/Q5_1; llama.cpp's K-quants keep it <= 0, their 6-bit min
    codes being unsigned). With ``fp16`` both are rounded to fp16 before they are judged. Returns
    (scale, min, curvature ``sum wt L^2``)."""
    xmin, xmax = x.amin(dim=1), x.amax(dim=1)
    if not free_min:
        xmin = xmin.clamp(max=0)
    if clip is not None:
        xmin, xmax = xmin * clip, xmax * clip
    rng = xmax - xmin
    dead = rng <= 0
    rng = torch.where(dead, torch.ones_like(rng), rng)
    sw = wt.sum(dim=1)
    wx = wt * x
    sx = wx.sum(dim=1)
    sxx = (wx * x).sum(dim=1)
    finalists = _Finalists(x.shape[0], 2, like=x)
    plain = (rng / nmax, xmin)
    if fp16:
        plain = (plain[0].half().float(), plain[1].half().float())
    # The min/max pair, judged with its own codes as llama.cpp's make_qkx3_quants starts its walk.
    L = ((x - xmin[:, None]) * (nmax / rng)[:, None]).round_().clamp_(0, nmax)
    wL = wt * L
    sl, sl2, sxl = wL.sum(dim=1), (wL * L).sum(dim=1), (wx * L).sum(dim=1)
    scale, mn = plain
    finalists.offer(sxx - 2 * scale * sxl - 2 * mn * sx + scale * scale * sl2 + 2 * scale * mn * sl + mn * mn * sw,
                    scale, mn)
    cur_min = xmin
    for step in (range(0, 37, 9) if quick else range(37)):
        span = xmax - cur_min
        span = torch.where(span > 0, span, torch.ones_like(span))
        iscale = (-0.9 + 0.05 * step + nmax) / span
        L = ((x - cur_min[:, None]) * iscale[:, None]).round_().clamp_(0, nmax)
        wL = wt * L
        sl = wL.sum(dim=1)
        sl2 = (wL * L).sum(dim=1)
        sxl = (wx * L).sum(dim=1)
        D = sw * sl2 - sl * sl
        ok = D > 0
        Dsafe = torch.where(ok, D, torch.ones_like(D))
        scale = (sw * sxl - sx * sl) / Dsafe
        mn = (sl2 * sx - sl * sxl) / Dsafe
        if not free_min:
            pos = mn > 0
            mn = torch.where(pos, torch.zeros_like(mn), mn)
            scale = torch.where(pos, _safe_div(sxl, sl2, scale), scale)
        if fp16:
            scale, mn = scale.half().float(), mn.half().float()
        err = sxx - 2 * scale * sxl - 2 * mn * sx + scale * scale * sl2 + 2 * scale * mn * sl + mn * mn * sw
        won = finalists.offer(err, scale, mn, valid=ok & (scale > 0))
        # As in make_qkx3_quants the search walks: a candidate that wins moves the min the next ones start from.
        cur_min = torch.where(won, mn, cur_min)
    candidates = [plain] + [(finalists.vals[i, 0], finalists.vals[i, 1]) for i in range(finalists.vals.shape[0])]
    best_err = torch.full_like(rng, float("inf"))
    best_s, best_m, best_c = torch.zeros_like(rng), torch.zeros_like(rng), torch.zeros_like(rng)
    for scale, mn in candidates:
        err, curv = _asym_error(x, wt, scale, mn, nmax)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, scale, best_s)
        best_m = torch.where(better, mn, best_m)
        best_c = torch.where(better, curv, best_c)
    best_s = torch.where(dead, torch.zeros_like(best_s), best_s)
    best_m = torch.where(dead, plain[1], best_m)
    return best_s, best_m, best_c


def _asym_error(x, wt, scale, mn, nmax: int):
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)[:, None]
    L = ((x - mn[:, None]) / safe).round_().clamp_(0, nmax)
    L = torch.where(scale[:, None] == 0, torch.zeros_like(L), L)
    diff = x - (scale[:, None] * L + mn[:, None])
    return (wt * diff * diff).sum(dim=1), (wt * L * L).sum(dim=1)


def search_table(x: torch.Tensor, wt: torch.Tensor, T: torch.Tensor, clip=None, fp16: bool = False, ntry: int = 7,
                 quick: bool = False):
    """Scale per row of ``x`` (N, n) for codes on the non-uniform levels ``T`` (IQ4_NL's): the search of
    ``quantize_row_iq4_nl_impl`` (``d = -max / T[0]`` refined by least squares, then
    ``id = (k + T[0]) / max`` for k in -ntry..ntry; ``quick``: every third), plus the plain
    ``-max / T[0]``. Returns (scale, curvature ``sum wt T[L]^2``)."""
    amax, maxv = _signed_max(x)
    if clip is not None:
        maxv = maxv * clip
    dead = amax < EPS
    maxv = torch.where(dead | (maxv == 0), torch.ones_like(maxv), maxv)
    mids = (T[1:] + T[:-1]) / 2
    wx = wt * x
    sxx = (wx * x).sum(dim=1)
    t0 = float(T[0])
    finalists = _Finalists(x.shape[0], 1, like=x)

    def offer(inv):  # codes for 1/inv, then the least-squares scale for them, judged with those codes
        q = T[torch.bucketize(x * inv[:, None], mids)]
        sumqx = (wx * q).sum(dim=1)
        sumq2 = (wt * q * q).sum(dim=1)
        d = _safe_div(sumqx, sumq2, 1 / inv)
        if fp16:
            d = d.half().float()
        finalists.offer(sxx - 2 * d * sumqx + d * d * sumq2, d)

    d0 = -maxv / t0
    offer(1 / d0)
    for k in (range(-ntry, ntry + 1, 3) if quick else range(-ntry, ntry + 1)):
        offer((k + t0) / maxv)
    candidates = [d0.half().float() if fp16 else d0] + [finalists.vals[i, 0] for i in range(finalists.vals.shape[0])]

    def error(scale):
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)[:, None]
        q = T[torch.bucketize(x / safe, mids)]
        diff = x - scale[:, None] * q
        return (wt * diff * diff).sum(dim=1), (wt * q * q).sum(dim=1)

    return _best_of(candidates, error, amax, dead)


def make_qp(x: torch.Tensor, nmax: int, qw: torch.Tensor):
    """llama.cpp's ``make_qp_quants``: one positive scale per row of ``x`` (M, k) (>= 0) and codes in
    [0, nmax], weighted by ``qw``: the best of ``iscale = (nmax + 0.1 k) / max`` for k in -4..4, then
    five rounds of changing one code at a time while the weighted fit improves. Returns (scale, codes)."""
    mx = x.amax(dim=1)
    dead = mx < EPS
    safe = torch.where(dead, torch.ones_like(mx), mx)
    best_is = nmax / safe
    L = (best_is[:, None] * x).round()
    diff = x - L / best_is[:, None]
    best = (qw * diff * diff).sum(dim=1)
    for k in range(-4, 5):
        if k == 0:
            continue
        iscale = (0.1 * k + nmax) / safe
        L = (iscale[:, None] * x).round_().clamp_(max=nmax)
        diff = x - L / iscale[:, None]
        mse = (qw * diff * diff).sum(dim=1)
        better = mse < best
        best = torch.where(better, mse, best)
        best_is = torch.where(better, iscale, best_is)
    L = (best_is[:, None] * x).round_().clamp_(max=nmax)
    sumlx = (qw * x * L).sum(dim=1)
    suml2 = (qw * L * L).sum(dim=1)
    for _ in range(5):
        changed = False
        for i in range(x.shape[1]):
            w, xi, li = qw[:, i], x[:, i], L[:, i]
            slx = sumlx - w * xi * li
            sl2 = suml2 - w * li * li
            ok = (slx > 0) & (sl2 > 0)
            new_l = (xi * sl2 / torch.where(ok, slx, torch.ones_like(slx))).round_().clamp_(max=nmax)
            slx_new = slx + w * xi * new_l
            sl2_new = sl2 + w * new_l * new_l
            take = ok & (new_l != li) & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
            if bool(take.any()):
                changed = True
                L[:, i] = torch.where(take, new_l, li)
                sumlx = torch.where(take, slx_new, sumlx)
                suml2 = torch.where(take, sl2_new, suml2)
        if not changed:
            break
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, torch.ones_like(suml2)), torch.zeros_like(suml2))
    scale = torch.where(dead, torch.zeros_like(scale), scale)
    return scale, torch.where(dead[:, None], torch.zeros_like(L), L)


def weighted_error(w: torch.Tensor, q: torch.Tensor, importance: torch.Tensor | None) -> float:
    """``sum_ij importance_j (w_ij - q_ij)^2``: the expected increase of the layer's squared output
    error per token when ``importance`` is the input channels' mean square (plain MSE without it)."""
    d = (w.float() - q.float()).pow(2)
    if importance is not None:
        d = d * importance.float().reshape(1, -1)
    return float(d.sum())
