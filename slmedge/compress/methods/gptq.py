"""GPTQ (Frantar et al., 2022): quantize columns one by one, compensating the error with H^-1.

Follows IST-DASLab/gptq ``fasterquant`` with the paper's names (H, Hinv, percdamp, blocksize).
With act-order the columns are visited by decreasing diag(H) but groups stay contiguous in
the original column order ("static groups": each group's scale comes from the weights before
any update), so GGUF and ONNX can hold the codes as they are.
"""

from __future__ import annotations

import torch

from ..quant import QuantSpec, dequantize, find_params, quantize
from .base import HessianStats, LinearResult, Method, register_method


def prepare_hinv(H: torch.Tensor, W: torch.Tensor, percdamp: float):
    """Damp H, zero dead columns of W, return the upper Cholesky factor of H^-1."""
    H = H.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    damp = percdamp * torch.mean(torch.diag(H))
    diag = torch.arange(H.shape[0], device=H.device)
    H[diag, diag] += damp
    try:
        L = torch.linalg.cholesky(H)
    except torch.linalg.LinAlgError:  # badly conditioned: damp harder rather than fail
        H[diag, diag] += 10 * damp + 1e-6
        L = torch.linalg.cholesky(H)
    Hinv = torch.cholesky_inverse(L)
    return torch.linalg.cholesky(Hinv, upper=True)


def gptq_quantize(
    W: torch.Tensor,
    H: torch.Tensor,
    spec: QuantSpec,
    blocksize: int = 128,
    percdamp: float = 0.01,
    actorder: bool = False,
):
    """Quantize W (out, in) given H (in, in). Returns (Q, codes, scales, zeros, perm)."""
    W = W.clone().float()
    rows, columns = W.shape
    g = spec.group_width(columns)
    n_groups = spec.num_groups(columns)
    scales = torch.zeros(rows, n_groups, device=W.device)
    zeros = torch.zeros(rows, n_groups, device=W.device)
    have_group = [False] * n_groups

    perm = None
    if actorder:
        # Static groups: every group's parameters from the unmodified weights, in original order.
        for gi in range(n_groups):
            scales[:, gi], zeros[:, gi] = find_params(W[:, gi * g : (gi + 1) * g], spec)
            have_group[gi] = True
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
        W = W[:, perm]
        H = H[perm][:, perm]
    Hinv = prepare_hinv(H, W, percdamp)
    order = perm.tolist() if perm is not None else list(range(columns))

    Q = torch.zeros_like(W)
    codes = torch.zeros(rows, columns, dtype=torch.uint8, device=W.device)
    for i1 in range(0, columns, blocksize):
        i2 = min(i1 + blocksize, columns)
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = order[i1 + i]
            gi = col // g
            if not have_group[gi]:
                # Without act-order the group starts here: its parameters come from the
                # weights as updated so far (the current block's own updates included).
                ahead = torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, : min(g, columns - col)]
                scales[:, gi], zeros[:, gi] = find_params(ahead, spec)
                have_group[gi] = True
            w = W1[:, i]
            d = Hinv1[i, i]
            q = quantize(w, scales[:, gi], zeros[:, gi], spec.maxq)
            dq = dequantize(q, scales[:, gi], zeros[:, gi])
            Q1[:, i] = dq
            codes[:, i1 + i] = q.to(torch.uint8)
            err = (w - dq) / d
            W1[:, i:] -= err.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err
        Q[:, i1:i2] = Q1
        W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])

    if perm is not None:
        invperm = torch.argsort(perm)
        Q = Q[:, invperm]
        codes = codes[:, invperm]
    return Q, codes, scales.half(), zeros.to(torch.uint8), perm


@register_method("gptq")
class GPTQ(Method):
    kind = "quantize"
    stats_class = HessianStats
    summary = "GPTQ: second-order error compensation column by column"

    def compress(self, name, weight, stats):
        r = self.recipe
        Q, codes, scales, zeros, perm = gptq_quantize(
            weight, stats.H, self.spec, blocksize=r.block_size, percdamp=r.damp, actorder=r.act_order
        )
        return LinearResult(Q, self.spec, codes, scales, zeros, perm=perm)
