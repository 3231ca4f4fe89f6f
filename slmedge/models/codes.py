"""The stored form of compressed weights and its arithmetic: integer codes <-> weights, packing.

The one definition of ``w = scale * (q - zero)`` and of the packed layouts, in the lowest layer
that reads them: loading a compact artifact (``models.artifact_weights``) rebuilds its weights
with the very operations the methods used when they chose the codes, and
``compress.quant`` (which chooses them) re-exports every name here. See ``compress.quant`` for
the grid's conventions.
"""

from __future__ import annotations

import numpy as np
import torch


def group_width(group_size: int, columns: int) -> int:
    """Columns per group: ``group_size`` (-1: the whole row), cut at the layer's edge."""
    return columns if group_size == -1 else min(group_size, columns)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return scale * (q - zero)


def expand_columns(params: torch.Tensor, width: int, columns: int) -> torch.Tensor:
    """(rows, G) group parameters of ``width``-column groups -> (rows, columns), one value per column."""
    return params.repeat_interleave(width, dim=1)[:, :columns]


def dequantize_grouped(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, width: int) -> torch.Tensor:
    """fp32 weights of (rows, cols) codes under per-group scales and zero points.

    ``dequantize``'s arithmetic, ``s * (q - z)`` per element (the same bits); when every group is
    whole the group parameters are broadcast over each group instead of expanded to weight-sized
    tensors (8x faster on a 1536 x 8960 weight)."""
    rows, cols = codes.shape
    if scales.shape[1] * width == cols:
        # dequantize(q, s, z) computed in the codes' own fp32 copy: 3x faster than allocating
        # (q - z) and its product (68 -> 24 ms on the weight above).
        q = codes.to(torch.float32, copy=True).reshape(rows, -1, width)
        return q.sub_(zeros.float()[:, :, None]).mul_(scales.float()[:, :, None]).view(rows, cols)
    s = expand_columns(scales.float(), width, cols)
    z = expand_columns(zeros.float(), width, cols)
    return dequantize(codes.float(), s, z)


def codes_per_byte(bits: int) -> int:
    return 4 if bits <= 2 else 2 if bits <= 4 else 1


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(rows, cols) uint8 codes -> (rows, ceil(cols/k)) bytes; element k*i+j in bits j*w.. (low first).

    With 4-bit codes this is ONNX MatMulNBits' layout (element 2i in the low nibble).
    """
    k = codes_per_byte(bits)
    codes = codes.to(torch.uint8)
    if k == 1:
        return codes.contiguous()
    width = 8 // k
    rows, cols = codes.shape
    pad = (-cols) % k
    c = (torch.nn.functional.pad(codes, (0, pad)) if pad else codes).reshape(rows, -1, k)
    packed = c[:, :, 0].clone()
    for j in range(1, k):
        packed |= c[:, :, j] << (width * j)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    k = codes_per_byte(bits)
    p = packed.to(torch.uint8)
    if k == 1:
        return p[:, :cols]
    width = 8 // k
    out = torch.empty(p.shape[0], p.shape[1], k, dtype=torch.uint8)
    for j in range(k):
        torch.bitwise_and(p >> (width * j), (1 << width) - 1, out=out[:, :, j])
    return out.reshape(p.shape[0], -1)[:, :cols]


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.packbits(mask.numpy().astype(bool), axis=1, bitorder="little"))


def unpack_mask(packed: torch.Tensor, cols: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(packed.numpy(), axis=1, bitorder="little")[:, :cols].astype(bool))
