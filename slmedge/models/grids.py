"""llama.cpp's quantization grids as data: what a code means, and codes -> weights.

A grid says which values a weight may take. Every GGUF block type written from codes has the same
shape of arithmetic, the one the ``gguf`` package's ``dequantize`` (and llama.cpp's) computes:

    w = A * T[q]          (+ B where the grid has a min)

``q`` is the code of one weight (an index into the grid's ``levels`` T), ``A`` is the effective
scale of its sub-block and ``B`` its offset, both fp32 and derived from what the block stores:

- 32-wide blocks (Q4_0, Q5_0, Q8_0, IQ4_NL; Q4_1, Q5_1 with a min): ``A = d`` and ``B = m``, fp16 each;
- 256-wide super-blocks of 16 or 32-wide sub-blocks (Q3_K, Q6_K, IQ4_XS; Q4_K, Q5_K with mins):
  ``A = d * (sc - offset)`` with an fp16 ``d`` per super-block and an integer scale code ``sc`` per
  sub-block, ``B = -(dmin * mc)`` with an fp16 ``dmin`` and a 6-bit min code ``mc``; each product
  rounded to fp32 once, as the ``gguf`` package and llama.cpp compute it.

The codes, the fp16 scales and the sub-block scale codes are what an artifact keeps (its
``fields``), so a weight is rebuilt bit for bit as the GGUF block decodes, in ``decode``. Rows not
divisible by a super-block take llama.cpp's own fallback type (``Grid.fallback``, from
``tensor_type_fallback`` in llama.cpp's src/llama-quant.cpp).

The registry (``GRIDS``, ``register_grid``) holds one entry per grid; the searches that choose the
scales (``compress.grid_fit``) and the GGUF block layouts (``export.gguf_blocks``) read these
entries. This module is the lowest layer that needs them: loading an artifact rebuilds its weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..registry import Registry

# llama.cpp's non-linear 4-bit grid (ggml-common.h kvalues_iq4nl).
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
QK_K = 256  # values per K-quant / IQ4_XS super-block


@dataclass(frozen=True)
class Grid:
    """One llama.cpp block type as a quantization grid (see the module docstring).

    ``search`` names the scale search that fits it (``compress.grid_fit``); ``weighting`` and
    ``data_free`` how each weight counts in that search with and without calibration statistics
    (llama.cpp's ``quant_weights`` formulas, per type); ``fallback`` is the type llama.cpp writes
    instead for rows whose width is not a multiple of ``block``; ``ftype`` the llama.cpp file type
    of a file mostly of this grid (what llama.cpp's quantizer is told for the tensors slmedge leaves
    uncoded, token embeddings and output)."""

    name: str
    ggml: str  # gguf.GGMLQuantizationType member
    bits: int  # bits of a code
    levels: tuple[int, ...]  # the value of each code (T)
    block: int  # values per GGUF block along a row
    sub: int  # values per scale (the sub-block; == block for 32-wide types)
    type_size: int  # bytes per GGUF block
    search: str  # "sym", "asym", "table" (compress.grid_fit)
    min: bool = False  # an additive offset per (sub-)block
    sub_bits: int = 0  # bits of a sub-block scale code (0: the block's scale is d itself)
    sub_offset: int = 0  # a sub-block's scale is d * (sc - sub_offset)
    weighting: str = "row"  # "row": qw*sqrt(sum(x^2)/n_row + x^2); "super": qw*sqrt(2*sum(x^2)/block + x^2); "plain": qw
    data_free: str = "one"  # without statistics: "one" (plain MSE), "square" (x^2), "avabs" (sqrt(sigma2) + |x|)
    fallback: str | None = None
    ftype: str = ""  # gguf.LlamaFileType member

    @property
    def uniform(self) -> bool:
        """Whether the levels are consecutive integers (codes are a rounding, not a table lookup)."""
        return list(self.levels) == list(range(self.levels[0], self.levels[0] + len(self.levels)))

    @property
    def has_zero(self) -> bool:
        """Whether an exact zero weight is on the grid whatever the scales (pruned weights stay zero)."""
        return 0 in self.levels and not self.min

    @property
    def bits_per_weight(self) -> float:
        """Bits per weight as GGUF stores it: codes, scales, mins and sub-block codes together."""
        return self.type_size * 8 / self.block

    @property
    def fields(self) -> tuple[str, ...]:
        """The tensors an artifact keeps per linear besides the codes (``field_shapes``)."""
        if self.sub_bits:
            return ("d", "dmin", "sc", "mc") if self.min else ("d", "sc")
        return ("d", "m") if self.min else ("d",)

    def field_shapes(self, rows: int, cols: int) -> dict[str, tuple[int, int]]:
        blocks, subs = cols // self.block, cols // self.sub
        return {"d": (rows, blocks), "m": (rows, blocks), "dmin": (rows, blocks), "sc": (rows, subs),
                "mc": (rows, subs)}

    def group_width(self, columns: int) -> int:
        """Columns per scale (the sub-block): what AWQ's clip search chooses a ratio for."""
        return self.sub

    def num_groups(self, columns: int) -> int:
        return columns // self.sub

    def describe(self) -> str:
        return self.name.upper()

    def why_not(self, columns: int) -> str | None:
        """Why rows ``columns`` wide cannot be written in this grid's blocks (None: they can)."""
        if columns % self.block:
            return f"{self.name} needs rows divisible by {self.block}, this one has {columns}"
        return None


GRIDS: Registry = Registry("grid")


def register_grid(grid: Grid) -> Grid:
    return GRIDS.add(grid.name, grid)


def _uniform(lo: int, bits: int) -> tuple[int, ...]:
    return tuple(range(lo, lo + 2**bits))


# 32-wide blocks: one fp16 scale (and min) per block.
register_grid(Grid("q4_0", "Q4_0", 4, _uniform(-8, 4), 32, 32, 18, "sym", ftype="MOSTLY_Q4_0"))
register_grid(Grid("q4_1", "Q4_1", 4, _uniform(0, 4), 32, 32, 20, "asym", min=True, ftype="MOSTLY_Q4_1"))
register_grid(Grid("q5_0", "Q5_0", 5, _uniform(-16, 5), 32, 32, 22, "sym", ftype="MOSTLY_Q5_0"))
register_grid(Grid("q5_1", "Q5_1", 5, _uniform(0, 5), 32, 32, 24, "asym", min=True, ftype="MOSTLY_Q5_1"))
register_grid(Grid("q8_0", "Q8_0", 8, _uniform(-128, 8), 32, 32, 34, "sym", ftype="MOSTLY_Q8_0"))
register_grid(Grid("iq4_nl", "IQ4_NL", 4, KVALUES_IQ4NL, 32, 32, 18, "table", weighting="super", data_free="square",
                   ftype="MOSTLY_IQ4_NL"))
# 256-wide super-blocks: an fp16 scale (and min) per super-block, integer scale (and min) codes per sub-block.
register_grid(Grid("iq4_xs", "IQ4_XS", 4, KVALUES_IQ4NL, QK_K, 32, 136, "table", sub_bits=6, sub_offset=32,
                   weighting="super", data_free="square", fallback="iq4_nl", ftype="MOSTLY_IQ4_XS"))
register_grid(Grid("q3_k", "Q3_K", 3, _uniform(-4, 3), QK_K, 16, 110, "sym", sub_bits=6, sub_offset=32,
                   weighting="super", data_free="square", fallback="q4_0", ftype="MOSTLY_Q3_K_S"))
register_grid(Grid("q4_k", "Q4_K", 4, _uniform(0, 4), QK_K, 32, 144, "asym", min=True, sub_bits=6,
                   weighting="super", data_free="avabs", fallback="q5_0", ftype="MOSTLY_Q4_K_S"))
register_grid(Grid("q5_k", "Q5_K", 5, _uniform(0, 5), QK_K, 32, 176, "asym", min=True, sub_bits=6,
                   weighting="super", data_free="avabs", fallback="q5_1", ftype="MOSTLY_Q5_K_S"))
register_grid(Grid("q6_k", "Q6_K", 6, _uniform(-32, 6), QK_K, 16, 210, "sym", sub_bits=8, sub_offset=128,
                   weighting="plain", data_free="square", fallback="q8_0", ftype="MOSTLY_Q6_K"))


def get_grid(name: str) -> Grid:
    if name not in GRIDS:
        raise ConfigError(f"unknown grid '{name}'; choose one of: {', '.join(GRIDS)}")
    return GRIDS[name]


def grid_for_width(name: str, columns: int) -> Grid:
    """The grid llama.cpp itself would write rows ``columns`` wide in when asked for ``name``: the grid,
    or its fallback where the rows are not divisible by its super-block (``tensor_type_fallback``).
    Rows that fit no 32-wide block either are refused (llama.cpp would leave them in F16)."""
    grid = get_grid(name)
    if grid.why_not(columns) and grid.fallback is not None:
        grid = GRIDS[grid.fallback]
    why = grid.why_not(columns)
    if why:
        raise ConfigError(f"grid {name}: {why} (llama.cpp would leave such a tensor in F16); skip the layer "
                          "(--skip) or use the uniform grid (--bits/--group-size)")
    return grid


# --- codes -> weights -------------------------------------------------------------------------


def effective(grid: Grid, fields: dict, rows: int, cols: int):
    """(A, B) per (row, sub-block), fp32: the scale and offset every code of a sub-block is decoded
    with (B None where the grid has no min). One fp32 product each, as the GGUF block decodes."""
    import torch

    d = fields["d"].float()
    per = grid.block // grid.sub
    if grid.sub_bits:
        scale_codes = fields["sc"].float() - grid.sub_offset  # small integers: exact
        A = d.repeat_interleave(per, dim=1) * scale_codes
        B = -(fields["dmin"].float().repeat_interleave(per, dim=1) * fields["mc"].float()) if grid.min else None
    else:
        A = d
        B = fields["m"].float() if grid.min else None
    assert A.shape == (rows, cols // grid.sub), (A.shape, rows, cols)
    return A.contiguous(), (B.contiguous() if B is not None else None)


def levels_tensor(grid: Grid, device=None):
    import torch

    return torch.tensor(grid.levels, dtype=torch.float32, device=device)


def decode(grid: Grid, codes, fields: dict):
    """fp32 weights (rows, cols) of ``codes`` (uint8 indices into ``grid.levels``) under ``fields``:
    ``A * T[q] (+ B)`` per sub-block, the very products the GGUF block's dequantization computes."""
    rows, cols = codes.shape
    A, B = effective(grid, fields, rows, cols)
    values = levels_tensor(grid, codes.device)[codes.long()].view(rows, cols // grid.sub, grid.sub)
    w = values.mul_(A[:, :, None])
    if B is not None:
        w.add_(B[:, :, None])
    return w.view(rows, cols)
