"""The quantization grid: bits, group size, symmetry; weights <-> integer codes.

Conventions (shared with the exporters, see DESIGN.md "numeric contracts"):

- Groups run along the input dimension (columns of a ``(out, in)`` weight), contiguous in the
  original column order. ``group_size = -1`` means one group per row (per-channel). When the
  group size does not divide the width, the last group is shorter ("ragged"): it has its own
  scale and zero point like any other group, so every format that stores 32-wide blocks (GGUF)
  or padded blocks (ONNX MatMulNBits) can hold it exactly.
- ``w = scale * (q - zero)`` with integer codes ``q`` in ``[0, 2**bits - 1]``.
- Symmetric: ``zero = 2**(bits-1)`` and ``scale = m / -2**(bits-1)`` where ``m`` is the group's
  value of largest magnitude (sign kept), so that value is exact (llama.cpp's Q4_0/Q8_0 choice;
  the scale may be negative). 4-bit symmetric codes are Q4_0's ``x = d*(q-8)`` as they are.
- Asymmetric: the range ``[min(w, 0), max(w, 0)]`` over ``2**bits - 1`` steps and an integer zero
  point (zero stays exactly representable, which pruned weights rely on); Q4_1's ``x = d*q + m``
  with ``d = scale``, ``m = -scale*zero``.
- Scales are rounded to float16 when chosen, so the dequantized weights are exactly what fp16
  scale formats (GGUF, ONNX fp16) reproduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..models.grids import Grid, get_grid
from ..models.codes import (codes_per_byte, dequantize, dequantize_grouped, expand_columns, group_width, pack_codes,
                            pack_mask, unpack_codes, unpack_mask)

__all__ = ["Grid", "QuantSpec", "entry_spec", "fake_quantize_any", "quantize_any", "codes_per_byte", "dequantize", "dequantize_codes", "expand_groups", "fake_quantize",
           "find_params", "group_params", "pack_codes", "pack_mask", "quantize", "quantize_groups", "unpack_codes", "unpack_mask"]


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 4
    group_size: int = 128  # -1: one group per row
    symmetric: bool = False

    def __post_init__(self):
        if not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ConfigError(f"bits must be an integer from 2 to 8, got {self.bits}")
        if self.group_size != -1 and (not isinstance(self.group_size, int) or self.group_size < 1):
            raise ConfigError(f"group size must be a positive integer or -1 (per channel), got {self.group_size}")

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    def group_width(self, columns: int) -> int:
        return group_width(self.group_size, columns)

    def num_groups(self, columns: int) -> int:
        return math.ceil(columns / self.group_width(columns))

    def describe(self) -> str:
        g = "per-channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"W{self.bits} {g} {'sym' if self.symmetric else 'asym'}"


def find_params(w: torch.Tensor, spec: QuantSpec, clip: torch.Tensor | float | None = None):
    """Scale and zero point per row of ``w`` (rows, n), one group's columns.

    ``clip`` (per row or scalar, in (0, 1]) shrinks the range (AWQ's clip search, MSE grids).
    Returns ``scale`` (rows,) float32, already rounded to fp16, and ``zero`` (rows,) float32
    holding integers.
    """
    w = w.float()
    # amin/amax rather than min/max/aminmax/argmax: the same values, several times faster on
    # narrow groups (torch's index-tracking reductions are slow along a short last dimension).
    xmin, xmax = w.amin(dim=1), w.amax(dim=1)
    if spec.symmetric:
        m = torch.where(-xmin > xmax, xmin, xmax)  # the value of largest magnitude, sign kept
        tie = -xmin == xmax  # +a and -a both there (or all zeros): the first one, as argmax picks
        if bool(tie.any()):
            rows = tie.nonzero().squeeze(1)
            sub = w[rows]
            m[rows] = sub.gather(1, sub.abs().argmax(dim=1, keepdim=True)).squeeze(1)
        if clip is not None:
            m = m * clip
        scale = m / -(2 ** (spec.bits - 1))
        zero = torch.full_like(scale, 2 ** (spec.bits - 1))
    else:
        xmin, xmax = xmin.clamp(max=0), xmax.clamp(min=0)
        if clip is not None:
            xmin, xmax = xmin * clip, xmax * clip
        scale = (xmax - xmin) / spec.maxq
        zero = torch.zeros_like(scale)
    scale = scale.half().float()
    tiny = scale.abs() < 1e-8  # an all-zero group: any scale gives zeros; keep it finite
    scale = torch.where(tiny, torch.ones_like(scale), scale)
    if not spec.symmetric:
        zero = torch.round(-xmin / scale).clamp(0, spec.maxq)
        zero = torch.where(tiny, torch.zeros_like(zero), zero)
    return scale, zero


def quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Integer codes (as float) of ``w`` under per-row (or broadcast) ``scale``/``zero``."""
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def fake_quantize(w: torch.Tensor, spec: QuantSpec, clip=None) -> torch.Tensor:
    """Round ``w`` (rows, cols) to the grid group by group and return the dequantized values."""
    return quantize_groups(w, spec, clip=clip)[0]


def _group_parts(cols: int, g: int):
    """(start, count, width): the whole groups at once, then a ragged last group on its own."""
    full = cols // g
    return [(0, full, g)] + ([(full * g, 1, cols - full * g)] if cols % g else [])


def group_params(w: torch.Tensor, spec: QuantSpec, clip=None):
    """Scale and zero point of every group of ``w`` (rows, cols): two (rows, G) float32 tensors,
    exactly what ``find_params`` gives group by group."""
    rows, cols = w.shape
    g = spec.group_width(cols)
    scales, zeros = [], []
    for start, count, width in _group_parts(cols, g):
        block = w[:, start : start + count * width].float().reshape(rows * count, width)
        scale, zero = find_params(block, spec, _clip_part(clip, start // g, count))
        scales.append(scale.reshape(rows, count))
        zeros.append(zero.reshape(rows, count))
    return _cat(scales), _cat(zeros)


def _clip_part(clip, gi: int, count: int):
    if isinstance(clip, torch.Tensor) and clip.dim() == 2:
        return clip[:, gi : gi + count].reshape(-1)
    return clip


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def quantize_groups(w: torch.Tensor, spec: QuantSpec, clip=None, overwrite: bool = False):
    """Round-to-nearest of a whole weight, group by group.

    ``clip`` is None, a scalar, or (rows, n_groups). Returns (dequantized fp32, codes uint8,
    scales fp16 (rows, G), zeros uint8 (rows, G)).

    The same operations as ``quantize`` then ``dequantize`` (``clamp(round(w / s) + z)``, then
    ``s * (q - z)``, models.codes' ``dequantize``), on whole groups at once, in place, with no
    concatenation when every group is whole. With ``overwrite`` a contiguous fp32 ``w`` whose groups
    are all whole is rounded in its own storage (the dequantized weight returned is ``w``): no
    weight-sized tensor is allocated at all.
    """
    rows, cols = w.shape
    g = spec.group_width(cols)
    deqs, codes, scales, zeros = [], [], [], []
    for start, count, width in _group_parts(cols, g):
        block = w[:, start : start + count * width].float().reshape(rows * count, width)
        scale, zero = find_params(block, spec, _clip_part(clip, start // g, count))
        s, z = scale[:, None], zero[:, None]
        q = (block.div_(s) if overwrite else torch.div(block, s)).round_().add_(z).clamp_(0, spec.maxq)
        codes.append(q.to(torch.uint8).reshape(rows, count * width))
        # dequantize(q, s, z) = s * (q - z), computed in q's own storage: (q - z) * s is the
        # same float product, and no new weight-sized tensor is allocated (allocations are
        # what this function spent most of its time on).
        deqs.append(q.sub_(z).mul_(s).reshape(rows, count * width))
        scales.append(scale.reshape(rows, count))
        zeros.append(zero.reshape(rows, count))
    return _cat(deqs), _cat(codes), _cat(scales).half(), _cat(zeros).to(torch.uint8)


def expand_groups(params: torch.Tensor, spec: QuantSpec, columns: int) -> torch.Tensor:
    """(rows, G) group parameters -> (rows, columns), one value per column."""
    return expand_columns(params, spec.group_width(columns), columns)


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    return dequantize_grouped(codes, scales, zeros, spec.group_width(codes.shape[1]))


# Packing for storage (codes_per_byte, pack_codes, unpack_codes, pack_mask, unpack_mask) and the
# dequantization arithmetic are defined in models.codes, which reads them when a compact artifact
# is loaded; they are imported above.


# --- either grid: the uniform one (QuantSpec) or one of llama.cpp's (models.grids.Grid) ------------


def quantize_any(w: torch.Tensor, spec, clip=None, importance: torch.Tensor | None = None, overwrite: bool = False,
                 quick: bool = False):
    """Round ``w`` (rows, cols) onto ``spec``: (dequantized fp32, codes uint8, scales, zeros, fields).

    The uniform grid (``QuantSpec``): ``quantize_groups`` (min/max scales; ``importance`` unused),
    fields None. A llama.cpp grid: the importance-weighted scale search (``grid_fit.fit``; ``clip``
    per sub-block; ``quick``: a quarter of its candidates), scales and zeros None, fields its fp16 scales
    and integer sub-block codes."""
    if isinstance(spec, Grid):
        from .grid_fit import fit

        found = fit(spec, w, importance, clip, quick=quick)
        return found.weight, found.codes, None, None, found.fields
    deq, codes, scales, zeros = quantize_groups(w, spec, clip=clip, overwrite=overwrite)
    return deq, codes, scales, zeros, None


def fake_quantize_any(w: torch.Tensor, spec, clip=None, importance: torch.Tensor | None = None,
                      quick: bool = False) -> torch.Tensor:
    """The dequantized weight of ``quantize_any`` alone."""
    return quantize_any(w, spec, clip=clip, importance=importance, quick=quick)[0]


def entry_spec(entry: dict):
    """The grid of an artifact's layer entry (its manifest's ``layers``): a llama.cpp ``Grid``, the uniform
    ``QuantSpec``, or None for a linear that is only pruned."""
    if "grid" in entry:
        return get_grid(entry["grid"])
    if "bits" in entry:
        return QuantSpec(entry["bits"], entry["group_size"], entry["symmetric"])
    return None
