"""SparseGPT (Frantar & Alistarh, 2023): prune with second-order weight reconstruction.

Follows IST-DASLab/sparsegpt ``fasterprune``. Comparison group: each block of ``blocksize``
columns (the paper's adaptive mask selection) drops exactly ``round(rows * width * ratio)``
weights; N:M drops N of every M consecutive weights of a row. With ``bits`` set the surviving
weights are quantized jointly (the error of both is compensated together).
"""

from __future__ import annotations

import torch

from ..quant import QuantSpec, dequantize, find_params, quantize
from .base import HessianStats, LinearResult, Method, register_method
from .gptq import prepare_hinv


def sparsegpt_prune(
    W: torch.Tensor,
    H: torch.Tensor,
    sparsity,
    spec: QuantSpec | None = None,
    blocksize: int = 128,
    percdamp: float = 0.01,
):
    """Returns (W_pruned, keep_mask, codes, scales, zeros); the last three None without ``spec``."""
    W = W.clone().float()
    rows, columns = W.shape
    Hinv = prepare_hinv(H, W, percdamp)
    prunen, prunem = (sparsity.n, sparsity.m) if sparsity.is_nm else (0, 0)
    if prunem and columns % prunem:
        raise ValueError(f"{prunen}:{prunem} sparsity needs the input width ({columns}) to be a multiple of {prunem}")
    if prunem and blocksize % prunem:
        blocksize = max(prunem, blocksize - blocksize % prunem)

    g = spec.group_width(columns) if spec else columns
    n_groups = spec.num_groups(columns) if spec else 0
    scales = torch.zeros(rows, n_groups, device=W.device)
    zeros = torch.zeros(rows, n_groups, device=W.device)
    codes = torch.zeros(rows, columns, dtype=torch.uint8, device=W.device) if spec else None

    pruned = torch.zeros_like(W, dtype=torch.bool)
    for i1 in range(0, columns, blocksize):
        i2 = min(i1 + blocksize, columns)
        count = i2 - i1
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]

        if prunem == 0:
            tmp = W1**2 / (torch.diag(Hinv1).reshape(1, -1)) ** 2
            k = int(round(tmp.numel() * sparsity.ratio))
            mask1 = torch.zeros_like(W1, dtype=torch.bool)
            if k:
                mask1.view(-1)[torch.topk(tmp.flatten(), k, largest=False).indices] = True
        else:
            mask1 = torch.zeros_like(W1, dtype=torch.bool)

        for i in range(count):
            w = W1[:, i]
            d = Hinv1[i, i]
            if prunem and i % prunem == 0:
                tmp = W1[:, i : i + prunem] ** 2 / (torch.diag(Hinv1)[i : i + prunem].reshape(1, -1)) ** 2
                mask1.scatter_(1, i + torch.topk(tmp, prunen, dim=1, largest=False).indices, True)
            q = w.clone()
            q[mask1[:, i]] = 0
            if spec is not None:
                col = i1 + i
                gi = col // g
                if col % g == 0:
                    ahead = torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, : min(g, columns - col)]
                    scales[:, gi], zeros[:, gi] = find_params(ahead, spec)
                code = quantize(q, scales[:, gi], zeros[:, gi], spec.maxq)
                q = dequantize(code, scales[:, gi], zeros[:, gi])  # pruned: code == zero point -> 0
                codes[:, col] = code.to(torch.uint8)
            Q1[:, i] = q
            err = (w - q) / d
            W1[:, i:] -= err.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err
        pruned[:, i1:i2] = mask1
        W[:, i1:i2] = Q1
        W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])

    if spec is None:
        return W, ~pruned, None, None, None
    return W, ~pruned, codes, scales.half(), zeros.to(torch.uint8)


@register_method("sparsegpt")
class SparseGPT(Method):
    kind = "prune"
    stats_class = HessianStats
    summary = "SparseGPT: pruning with second-order reconstruction (optionally joint quantization)"

    def compress(self, name, weight, stats):
        r = self.recipe
        Wp, mask, codes, scales, zeros = sparsegpt_prune(
            weight, stats.H, self.sparsity, self.spec, blocksize=r.block_size, percdamp=r.damp
        )
        return LinearResult(Wp, self.spec, codes, scales, zeros, mask=mask)
