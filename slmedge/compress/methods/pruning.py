"""Choosing which weights to drop from a score, per comparison group."""

from __future__ import annotations

import torch


def prune_by_score(score: torch.Tensor, sparsity, group: str = "row") -> torch.Tensor:
    """Keep-mask (True = kept) that drops the lowest scores.

    ``group`` is the comparison group for unstructured sparsity: "row" (each output row drops
    exactly ``int(cols * ratio)``) or "layer" (the whole matrix drops ``int(numel * ratio)``).
    N:M sparsity drops exactly N of every M consecutive weights in a row, whatever ``group``.
    """
    rows, cols = score.shape
    drop = torch.zeros_like(score, dtype=torch.bool)
    if sparsity.is_nm:
        n, m = sparsity.n, sparsity.m
        if cols % m:
            raise ValueError(f"{n}:{m} sparsity needs the input width ({cols}) to be a multiple of {m}")
        blocks = score.reshape(rows, cols // m, m)
        idx = torch.topk(blocks, n, dim=2, largest=False).indices
        drop = torch.zeros_like(blocks, dtype=torch.bool).scatter_(2, idx, True).reshape(rows, cols)
    elif group == "row":
        k = int(cols * sparsity.ratio)
        if k:
            idx = torch.topk(score, k, dim=1, largest=False).indices
            drop.scatter_(1, idx, True)
    else:
        k = int(score.numel() * sparsity.ratio)
        if k:
            idx = torch.topk(score.flatten(), k, largest=False).indices
            drop.view(-1)[idx] = True
    return ~drop
