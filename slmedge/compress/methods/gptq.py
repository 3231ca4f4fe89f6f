"""GPTQ (Frantar et al., 2022): quantize columns one by one, compensating the error with H^-1.

Follows IST-DASLab/gptq ``fasterquant`` with the paper's names (H, Hinv, percdamp, blocksize).
With act-order the columns are visited by decreasing diag(H) but groups stay contiguous in
the original column order ("static groups": each group's scale comes from the weights before
any update), so GGUF and ONNX can hold the codes as they are.

Speed (the arithmetic is the reference's, operation for operation, so the codes are the same
bits): the weight is worked on transposed, one contiguous row per input column; every
per-column step writes into preallocated rows (no temporaries, no per-column gathers); the
column loop runs on one thread (its tensors are a few thousand floats: on two cores a second
OpenMP thread only adds a barrier per operation, which costs a scheduler slice whenever
anything else shares the cores); the damped-Cholesky factor of H^-1 and the act-order
permutation are computed once per Hessian, on one thread, and reused by every linear that
shares it (q/k/v, gate/up), where torch's MKL allows with its LAPACK routines run in place
(``compress.lapack``); the linears that share a Hessian are quantized in one column loop, their
rows stacked (``GPTQ.compress_shared``). The results are bit for bit those of the reference loop
run with ``torch.set_num_threads(1)`` (before, the Cholesky inverse's low bits followed the
thread count).
"""

from __future__ import annotations

import torch

from ...models.grids import Grid, effective, levels_tensor
from .. import lapack
from ..grid_fit import fit, table_midpoints
from ..quant import QuantSpec, find_params, group_params
from .base import HessianStats, LinearResult, Method, register_method, single_thread


def hinv_factor(H: torch.Tensor, percdamp: float):
    """Damped H -> (upper Cholesky factor of H^-1, dead columns): what depends on H alone."""
    H = H.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    damp = percdamp * torch.mean(torch.diag(H))
    diag = torch.arange(H.shape[0], device=H.device)
    H[diag, diag] += damp
    # hessian_plan calls this on one thread, where torch's own LAPACK runs in place (compress.lapack:
    # the same bits, without torch's layout copies); elsewhere torch's calls.
    cholesky = lapack.cholesky_columns if lapack.available(H) else torch.linalg.cholesky
    try:
        L = cholesky(H)
    except torch.linalg.LinAlgError:  # badly conditioned: damp harder rather than fail
        H[diag, diag] += 10 * damp + 1e-6
        L = cholesky(H)
    if cholesky is lapack.cholesky_columns:
        return lapack.upper_factor_of_inverse(L), dead
    Hinv = torch.cholesky_inverse(L)
    return torch.linalg.cholesky(Hinv, upper=True), dead


def prepare_hinv(H: torch.Tensor, W: torch.Tensor, percdamp: float):
    """Damp H, zero dead columns of W, return the upper Cholesky factor of H^-1."""
    Hinv, dead = hinv_factor(H, percdamp)
    W[:, dead] = 0
    return Hinv


def hessian_plan(H: torch.Tensor, percdamp: float, actorder: bool, stats=None):
    """(perm or None, Hinv factor, dead columns in the visiting order) for ``H``.

    Cached on ``stats`` (the statistics object linears fed the same input share), keyed by the
    settings: q/k/v (and gate/up) pay for one Cholesky, not three.
    """
    key = ("gptq", float(percdamp), bool(actorder))
    cache = getattr(stats, "plans", None) if stats is not None else None
    if cache is not None and key in cache:
        return cache[key]
    perm = None
    if actorder:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        H = H[perm][:, perm]
    with single_thread(always=True):
        # One thread: LAPACK's Cholesky inverse gives other low bits on two threads than on one
        # (so results depended on the machine's core count), and on two shared cores it took
        # 0.3-5 s per call against 0.01-0.1 s on one.
        Hinv, dead = hinv_factor(H, percdamp)
    plan = (perm, Hinv, dead)
    if cache is not None:
        cache[key] = plan
    return plan


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    spec: QuantSpec,
    blocksize: int = 128,
    percdamp: float = 0.01,
    actorder: bool = False,
    stats=None,
    own: bool = False,
):
    """Quantize W (out, in) given H (in, in). Returns (Q, codes, scales, zeros, perm).

    ``stats`` (optional): the HessianStats holding H, where the H-only work is cached. ``own``:
    W is the caller's fp32 scratch copy, worked on in place instead of cloned.
    """
    W = W if own and W.dtype == torch.float32 else W.clone().float()
    rows, columns = W.shape
    g = spec.group_width(columns)
    n_groups = spec.num_groups(columns)
    scales = torch.zeros(rows, n_groups, device=W.device)
    zeros = torch.zeros(rows, n_groups, device=W.device)

    perm, Hinv, dead = hessian_plan(H, percdamp, actorder, stats)
    if perm is not None:
        # Static groups: every group's parameters from the unmodified weights, in original order.
        scales, zeros = group_params(W, spec)
        W = W[:, perm]
    W[:, dead] = 0
    order = perm if perm is not None else torch.arange(columns, device=W.device)

    with single_thread():
        WT = W.t().contiguous()  # (in, out): input column j is the contiguous row WT[j]
        device = W.device
        del W  # WT is the working copy from here on (one weight-sized buffer fewer at the peak)
        QT = torch.empty_like(WT)
        CT = torch.empty_like(WT)  # integer codes, as float until the end
        if perm is not None:
            gcol = torch.div(order, g, rounding_mode="floor")
            ST = scales.t()[gcol].contiguous()  # each visited column's scale and zero point
            ZT = zeros.t()[gcol].contiguous()
        maxq = spec.maxq
        order_list = order.tolist()
        s = z = None
        for i1 in range(0, columns, blocksize):
            i2 = min(i1 + blocksize, columns)
            count = i2 - i1
            W1 = WT[i1:i2]  # updated in place: nothing reads these columns' weights afterwards
            Err1 = torch.empty(count, rows, device=device)
            Hinv1 = Hinv[i1:i2, i1:i2]
            for i in range(count):
                j = i1 + i
                if perm is not None:
                    s, z = ST[j], ZT[j]
                elif order_list[j] % g == 0:
                    # Without act-order the group starts here: its parameters come from the
                    # weights as updated so far (the current block's own updates included,
                    # the later blocks' lazy updates not yet).
                    gi = j // g
                    s, z = find_params(WT[j : j + min(g, columns - j)].t(), spec)
                    scales[:, gi], zeros[:, gi] = s, z
                w = W1[i]
                q = CT[j]
                torch.div(w, s, out=q)  # quantize: clamp(round(w / s) + z, 0, maxq)
                q.round_().add_(z).clamp_(0, maxq)
                dq = QT[j]
                torch.sub(q, z, out=dq).mul_(s)  # dequantize: s * (q - z), models.codes' arithmetic
                err = Err1[i]
                torch.sub(w, dq, out=err).div_(Hinv1[i, i])
                if i + 1 < count:
                    W1[i + 1 :].sub_(torch.outer(Hinv1[i, i + 1 :], err))
            if i2 < columns:
                # The lazy batch update of the columns after the block, as (out, in) like the reference.
                WT[i2:].sub_(Err1.t().matmul(Hinv[i1:i2, i2:]).t())

    Q = QT.t()
    codes = CT.t()
    if perm is not None:
        invperm = torch.argsort(perm)
        Q = Q[:, invperm]
        codes = codes[:, invperm]
    return Q.contiguous(), codes.to(torch.uint8).contiguous(), scales.half(), zeros.to(torch.uint8), perm


class GridColumns:
    """Rounding one input column at a time onto a llama.cpp grid whose scales were fixed before the
    column loop (GPTQ's and SparseGPT's, on ``models.grids``): the code of the level nearest each
    updated weight, and its value ``A * T[code] (+ B)``, the very products ``grids.decode`` computes.

    ``order``: the input columns in visiting order (act-order's permutation, or 0..cols-1); every
    per-column tensor is laid out in that order, one contiguous row per column, like GPTQ's ``WT``."""

    def __init__(self, grid: Grid, fields: dict, rows: int, columns: int, order: torch.Tensor):
        A, B = effective(grid, fields, rows, columns)  # (rows, n_sub)
        sub = torch.div(order, grid.sub, rounding_mode="floor")
        self.AT = A.t()[sub].contiguous()  # (columns, rows): each visited column's scales
        self.dead = self.AT == 0  # every code decodes alike there: the one nearest zero is kept
        self.safe = torch.where(self.dead, torch.ones_like(self.AT), self.AT)
        self.BT = B.t()[sub].contiguous() if B is not None else None
        self.uniform = grid.uniform
        self.lo, self.top = float(grid.levels[0]), float(len(grid.levels) - 1)
        self.T = levels_tensor(grid, A.device)
        self.mids = table_midpoints(grid, A.device)
        self.zero_code = float(self.T.abs().argmin())

    def step(self, j: int, w: torch.Tensor, code: torch.Tensor, dq: torch.Tensor) -> None:
        """Column ``j`` (visiting order) of weights ``w`` (rows,) -> its codes (as float) and dequantized values."""
        if self.BT is not None:
            torch.sub(w, self.BT[j], out=code).div_(self.safe[j])
        else:
            torch.div(w, self.safe[j], out=code)
        if self.uniform:
            code.round_().sub_(self.lo).clamp_(0, self.top)
        else:
            code.copy_(torch.bucketize(code, self.mids))
        code.masked_fill_(self.dead[j], self.zero_code)
        if self.uniform:
            torch.add(code, self.lo, out=dq)
        else:
            torch.index_select(self.T, 0, code.long(), out=dq)
        dq.mul_(self.AT[j])
        if self.BT is not None:
            dq.add_(self.BT[j])


def gptq_quantize_grid(W: torch.Tensor, H: torch.Tensor, grid: Grid, importance: torch.Tensor | None,
                       blocksize: int = 128, percdamp: float = 0.01, actorder: bool = False, stats=None,
                       own: bool = False):
    """GPTQ onto a llama.cpp grid. Returns (Q, codes, fields, perm).

    The scales are fixed first, from the weights before any update and ``importance`` (the grid's
    importance-weighted search, ``grid_fit.fit``: static groups, whatever the column order); the
    column loop then chooses each code and propagates its error with H^-1 as ``gptq_quantize`` does.
    """
    W = W if own and W.dtype == torch.float32 else W.clone().float()
    rows, columns = W.shape
    with single_thread():
        fields = fit(grid, W, importance).fields
    perm, Hinv, dead = hessian_plan(H, percdamp, actorder, stats)
    if perm is not None:
        W = W[:, perm]
    W[:, dead] = 0
    order = perm if perm is not None else torch.arange(columns, device=W.device)
    with single_thread():
        cols = GridColumns(grid, fields, rows, columns, order)
        WT = W.t().contiguous()  # (in, out), as in gptq_quantize
        device = W.device
        del W
        QT = torch.empty_like(WT)
        CT = torch.empty_like(WT)
        for i1 in range(0, columns, blocksize):
            i2 = min(i1 + blocksize, columns)
            count = i2 - i1
            W1 = WT[i1:i2]
            Err1 = torch.empty(count, rows, device=device)
            Hinv1 = Hinv[i1:i2, i1:i2]
            for i in range(count):
                j = i1 + i
                w = W1[i]
                cols.step(j, w, CT[j], QT[j])
                err = Err1[i]
                torch.sub(w, QT[j], out=err).div_(Hinv1[i, i])
                if i + 1 < count:
                    W1[i + 1 :].sub_(torch.outer(Hinv1[i, i + 1 :], err))
            if i2 < columns:
                WT[i2:].sub_(Err1.t().matmul(Hinv[i1:i2, i2:]).t())
    Q, codes = QT.t(), CT.t()
    if perm is not None:
        invperm = torch.argsort(perm)
        Q, codes = Q[:, invperm], codes[:, invperm]
    return Q.contiguous(), codes.to(torch.uint8).contiguous(), fields, perm


@register_method("gptq")
class GPTQ(Method):
    kind = "quantize"
    stats_class = HessianStats
    summary = "GPTQ: second-order error compensation column by column"
    settings = ("damp", "block_size", "act_order")

    def _quantize(self, weight, stats, spec, own=False) -> LinearResult:
        r = self.recipe
        if isinstance(spec, Grid):
            Q, codes, fields, perm = gptq_quantize_grid(weight, stats.H, spec, self.weighs_by(stats),
                                                        blocksize=r.block_size, percdamp=r.damp, actorder=r.act_order,
                                                        stats=stats, own=own)
            return LinearResult(Q, spec, codes, perm=perm, fields=fields)
        Q, codes, scales, zeros, perm = gptq_quantize(weight, stats.H, spec, blocksize=r.block_size, percdamp=r.damp,
                                                      actorder=r.act_order, stats=stats, own=own)
        return LinearResult(Q, spec, codes, scales, zeros, perm=perm)

    def compress(self, name, weight, stats):
        return self._quantize(weight, stats, self.spec_for(name, weight.shape[1]))

    def compress_shared(self, weights, stats):
        """The linears fed one input (q/k/v, gate/up) in one column loop, their rows stacked.

        Every step of the loop is row by row (a row's scale and zero point, its error, its share
        of the lazy update) given the Hessian, which they share, so each row comes out as it does
        alone (the same bits; tests/test_methods.py checks it), with one pass over the columns
        instead of one per linear: the loop's cost is the dispatch of ~10 small operations per
        column, whatever the number of rows."""
        specs = {name: self.spec_for(name, w.shape[1]) for name, w in weights.items()}
        if len(weights) == 1 or len(set(specs.values())) > 1:  # a budget may give them different grids
            return super().compress_shared(weights, stats)
        names = list(weights)
        rows = [weights[name].shape[0] for name in names]
        res = self._quantize(torch.cat([weights[name].float() for name in names]), stats, specs[names[0]], own=True)
        out = {}
        for i, name in enumerate(names):
            # Each linear's tensors in storage of their own, as when quantized alone.
            def part(t):
                return None if t is None else t.split(rows)[i].clone()

            out[name] = LinearResult(part(res.weight), res.spec, part(res.codes), part(res.scales), part(res.zeros),
                                     perm=res.perm, fields=None if res.fields is None else
                                     {k: part(v) for k, v in res.fields.items()})
        return out
