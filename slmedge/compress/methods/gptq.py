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

from .. import lapack
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


@register_method("gptq")
class GPTQ(Method):
    kind = "quantize"
    stats_class = HessianStats
    summary = "GPTQ: second-order error compensation column by column"

    def _quantize(self, weight, stats, own=False):
        r = self.recipe
        return gptq_quantize(weight, stats.H, self.spec, blocksize=r.block_size, percdamp=r.damp,
                             actorder=r.act_order, stats=stats, own=own)

    def compress(self, name, weight, stats):
        Q, codes, scales, zeros, perm = self._quantize(weight, stats)
        return LinearResult(Q, self.spec, codes, scales, zeros, perm=perm)

    def compress_shared(self, weights, stats):
        """The linears fed one input (q/k/v, gate/up) in one column loop, their rows stacked.

        Every step of the loop is row by row (a row's scale and zero point, its error, its share
        of the lazy update) given the Hessian, which they share, so each row comes out as it does
        alone (the same bits; tests/test_methods.py checks it), with one pass over the columns
        instead of one per linear: the loop's cost is the dispatch of ~10 small operations per
        column, whatever the number of rows."""
        if len(weights) == 1:
            return super().compress_shared(weights, stats)
        names = list(weights)
        rows = [weights[name].shape[0] for name in names]
        Q, codes, scales, zeros, perm = self._quantize(torch.cat([weights[name].float() for name in names]), stats,
                                                       own=True)
        out = {}
        for name, q, c, s, z in zip(names, Q.split(rows), codes.split(rows), scales.split(rows), zeros.split(rows)):
            # Each linear's tensors in storage of their own, as when quantized alone.
            out[name] = LinearResult(q.clone(), self.spec, c.clone(), s.clone(), z.clone(), perm=perm)
        return out
