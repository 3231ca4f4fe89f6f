"""SparseGPT (Frantar & Alistarh, 2023): prune with second-order weight reconstruction.

Follows IST-DASLab/sparsegpt ``fasterprune``. Comparison group: each block of ``blocksize``
columns (the paper's adaptive mask selection) drops exactly ``round(rows * width * ratio)``
weights; N:M drops N of every M consecutive weights of a row. With ``bits`` set the surviving
weights are quantized jointly (the error of both is compensated together).
"""

from __future__ import annotations

import torch

from ...models.grids import Grid
from ..grid_fit import fit
from ..quant import QuantSpec, find_params
from .base import HessianStats, LinearResult, Method, register_method, single_thread
from .gptq import GridColumns, hessian_plan, prepare_hinv  # noqa: F401 - prepare_hinv re-exported
from .pruning import smallest_k


def sparsegpt_prune(
    W: torch.Tensor,
    H: torch.Tensor,
    sparsity,
    spec: QuantSpec | Grid | None = None,
    blocksize: int = 128,
    percdamp: float = 0.01,
    stats=None,
    importance: torch.Tensor | None = None,
):
    """Returns (W_pruned, keep_mask, codes, scales, zeros); the last three None without ``spec``.

    On a llama.cpp grid (``spec`` a Grid with a zero level) the scales are fitted first, on the
    weights before pruning, weighing by ``importance`` (``grid_fit.fit``); each column's kept weights
    are then rounded onto them in the loop (``GridColumns``), and ``scales`` is the grid's fields
    (``zeros`` None).

    ``stats`` (optional): the HessianStats holding H, where the Cholesky factor is cached.
    Worked on transposed like GPTQ (see gptq.py), on one thread. Each block's mask holds the
    ``round(rows * width * ratio)`` smallest of the reference's scores w^2 / Hinv_ii^2
    (``smallest_k``: ties at the threshold by output row, then input column).
    """
    W = W.clone().float()
    rows, columns = W.shape
    _, Hinv, dead = hessian_plan(H, percdamp, False, stats)
    W[:, dead] = 0
    prunen, prunem = (sparsity.n, sparsity.m) if sparsity.is_nm else (0, 0)
    if prunem and columns % prunem:
        raise ValueError(f"{prunen}:{prunem} sparsity needs the input width ({columns}) to be a multiple of {prunem}")
    if prunem and blocksize % prunem:
        blocksize = max(prunem, blocksize - blocksize % prunem)

    grid = spec if isinstance(spec, Grid) else None
    fields = None
    if grid is not None:
        with single_thread():
            fields = fit(grid, W, importance).fields
        spec = None  # the uniform grid's per-group parameters are not used
    g = spec.group_width(columns) if spec else columns
    n_groups = spec.num_groups(columns) if spec else 0
    scales = torch.zeros(rows, n_groups, device=W.device)
    zeros = torch.zeros(rows, n_groups, device=W.device)

    prunedT = torch.zeros(columns, rows, dtype=torch.bool, device=W.device)  # (in, out), like WT
    with single_thread():
        WT = W.t().contiguous()  # (in, out): input column j is the contiguous row WT[j]
        QT = torch.empty_like(WT)
        CT = torch.empty_like(WT) if spec or grid else None  # codes, as float until the end
        on_grid = GridColumns(grid, fields, rows, columns, torch.arange(columns, device=W.device)) if grid else None
        s = z = None
        zero = torch.zeros((), dtype=W.dtype, device=W.device)
        for i1 in range(0, columns, blocksize):
            i2 = min(i1 + blocksize, columns)
            count = i2 - i1
            W1 = WT[i1:i2]  # updated in place; the block's results go to QT
            Err1 = torch.empty(count, rows, device=W.device)
            Hinv1 = Hinv[i1:i2, i1:i2]
            d2 = torch.diag(Hinv1) ** 2

            mask1T = prunedT[i1:i2]  # column i's mask as a contiguous row
            if prunem == 0:
                # The reference's scores w^2 / Hinv_ii^2, scored on the transposed block: the same
                # values, so the same set of weights (ties at the k-th value aside).
                scores = W1 ** 2
                scores.div_(d2.reshape(-1, 1))
                mask1T.copy_(smallest_k(scores, int(round(rows * count * sparsity.ratio))))
            else:
                mask1 = torch.zeros(rows, count, dtype=torch.bool, device=W.device)

            for i in range(count):
                w = W1[i]
                if prunem and i % prunem == 0:
                    tmp = W1[i : i + prunem].t().contiguous() ** 2 / d2[i : i + prunem].reshape(1, -1)
                    mask1.scatter_(1, i + torch.topk(tmp, prunen, dim=1, largest=False).indices, True)
                    mask1T[i : i + prunem] = mask1[:, i : i + prunem].t()
                q = QT[i1 + i]
                torch.where(mask1T[i], zero, w, out=q)  # +0.0 where pruned, like q[mask] = 0 (one op, not two)
                if spec is not None:
                    col = i1 + i
                    if col % g == 0:
                        ahead = WT[col : col + min(g, columns - col)]  # this block's updates so far, not the lazy ones
                        s, z = find_params(ahead.t(), spec)
                        scales[:, col // g], zeros[:, col // g] = s, z
                    code = CT[col]
                    torch.div(q, s, out=code)  # quantize: clamp(round(q / s) + z, 0, maxq)
                    code.round_().add_(z).clamp_(0, spec.maxq)
                    torch.sub(code, z, out=q).mul_(s)  # dequantize: s * (code - z); pruned: code == z -> 0
                elif on_grid is not None:
                    # a pruned weight is 0, whose nearest level is the grid's zero: it stays (+/-) 0
                    on_grid.step(i1 + i, q, CT[i1 + i], q)  # reads q before writing it
                err = Err1[i]
                torch.sub(w, q, out=err).div_(Hinv1[i, i])
                if i + 1 < count:
                    W1[i + 1 :].sub_(torch.outer(Hinv1[i, i + 1 :], err))
            if i2 < columns:
                WT[i2:].sub_(Err1.t().matmul(Hinv[i1:i2, i2:]).t())

    W = QT.t().contiguous()
    keep = ~prunedT.t().contiguous()
    if grid is not None:
        return W, keep, CT.t().to(torch.uint8).contiguous(), fields, None
    if spec is None:
        return W, keep, None, None, None
    return W, keep, CT.t().to(torch.uint8).contiguous(), scales.half(), zeros.to(torch.uint8)


@register_method("sparsegpt")
class SparseGPT(Method):
    kind = "prune"
    stats_class = HessianStats
    summary = "SparseGPT: pruning with second-order reconstruction (optionally joint quantization)"
    settings = ("damp", "block_size")

    def compress(self, name, weight, stats):
        r = self.recipe
        spec = self.spec_for(name, weight.shape[1]) if self.quantizes else None
        Wp, mask, codes, scales, zeros = sparsegpt_prune(
            weight, stats.H, self.sparsity, spec, blocksize=r.block_size, percdamp=r.damp, stats=stats,
            importance=self.weighs_by(stats) if isinstance(spec, Grid) else None)
        if isinstance(spec, Grid):
            return LinearResult(Wp, spec, codes, mask=mask, fields=scales)
        return LinearResult(Wp, spec, codes, scales, zeros, mask=mask)
