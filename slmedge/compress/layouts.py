"""onnxruntime's MatMulNBits layouts as budget choices: bits, block size and symmetry of one linear.

A size budget for ONNX (``Recipe.bpw`` with ``bpw_grids`` naming layouts, ``compress.budget``) picks,
per linear, one of these. A layout is the uniform grid (``QuantSpec``: an fp16-rounded scale and an
integer zero point per block of ``block`` input columns) that ``export.onnx`` writes as
``com.microsoft::MatMulNBits`` with its codes as they are, so what GPTQ or AWQ rounds onto at
compress time is what onnxruntime multiplies by.

Names: ``int4-gB`` (4-bit codes with a zero point per block, what onnxruntime's quantizers write
by default), ``int4-gB-sym`` (4-bit, no zero points: MatMulNBits' default zero 8), ``int8-gB``
(8-bit, no zero points: default zero 128), ``int8-gB-asym``; ``B`` a block size onnxruntime's
MatMulNBits kernels take (``BLOCKS``). A layout is offered to a linear only where its block divides
the linear's input width (a ragged last block would be padded: stored, multiplied and not used).

Sizes are counted as the ONNX file stores them (``Layout.linear_bits``): the codes, one fp32 scale
per block (MatMulNBits' scales have the activations' type, fp32 in the graphs slmedge writes) and,
where asymmetric, the zero points (4-bit: two per byte, each row's padded to a whole byte).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import ConfigError
from .quant import QuantSpec

BLOCKS = (16, 32, 64, 128, 256)  # MatMulNBits block sizes: powers of two from 16 (the builder's 16 to 256)
SCALE_BITS = 32  # an fp32 scale per block (the graph's activation type)
# What ``--bpw-grids onnx`` stands for: the layouts a row width of a multiple of 32 can take, 4- and 8-bit.
DEFAULT_LAYOUTS = ("int4-g32-sym", "int4-g32", "int4-g64", "int4-g128", "int8-g32", "int8-g64", "int8-g128")
ALIAS = "onnx"
_NAME = re.compile(r"^int(\d+)-g(\d+)(-sym|-asym)?$")
FORM = "int4-gB or int8-gB, optionally -sym or -asym, B one of " + ", ".join(map(str, BLOCKS))


@dataclass(frozen=True)
class Layout:
    bits: int  # 4 or 8
    block: int  # input columns per scale (MatMulNBits block_size)
    symmetric: bool  # no zero points: MatMulNBits' default zero, 2**(bits-1)

    @property
    def name(self) -> str:
        default = self.bits == 8  # int8 is symmetric unless told, int4 asymmetric
        suffix = "" if self.symmetric == default else ("-sym" if self.symmetric else "-asym")
        return f"int{self.bits}-g{self.block}{suffix}"

    @property
    def spec(self) -> QuantSpec:
        """The uniform grid GPTQ/AWQ/RTN round onto and the artifact keeps."""
        return QuantSpec(self.bits, self.block, self.symmetric)

    def why_not(self, columns: int) -> str | None:
        """Why rows ``columns`` wide do not take this layout (None: they do)."""
        if columns % self.block:
            return f"{self.name} needs rows divisible by {self.block}, this one has {columns}"
        return None

    def linear_bits(self, rows: int, columns: int) -> int:
        """Bits of a (rows, columns) linear's MatMulNBits tensors: codes, fp32 scales, zero points."""
        blocks = math.ceil(columns / self.block)
        codes = rows * blocks * self.block * self.bits
        scales = rows * blocks * SCALE_BITS
        zeros = 0 if self.symmetric else rows * 8 * (math.ceil(blocks / 2) if self.bits == 4 else blocks)
        return codes + scales + zeros

    def bits_per_weight(self, columns: int) -> float:
        return self.linear_bits(1, columns) / columns

    def describe(self) -> str:
        return self.name


def is_layout_name(name) -> bool:
    """Whether ``name`` is meant as an ONNX layout (rather than a llama.cpp grid): it reads ``int...``."""
    return isinstance(name, str) and (name.startswith("int") or name == ALIAS)


def parse_layout(name: str) -> Layout:
    """The layout ``name`` names; ConfigError naming what is wrong with it."""
    m = _NAME.match(name)
    if not m:
        raise ConfigError(f"unknown ONNX layout {name!r}: give {FORM} (e.g. int4-g32, int8-g128)")
    bits, block, sym = int(m.group(1)), int(m.group(2)), m.group(3)
    if bits not in (4, 8):
        raise ConfigError(f"ONNX layout {name!r}: onnxruntime's MatMulNBits holds 4- or 8-bit codes, not {bits}-bit")
    if block not in BLOCKS:
        raise ConfigError(f"ONNX layout {name!r}: onnxruntime's MatMulNBits has no kernel for block size {block}; "
                          f"block sizes are {', '.join(map(str, BLOCKS))}")
    return Layout(bits, block, (bits == 8) if sym is None else sym == "-sym")


def layout_names(names) -> tuple[str, ...]:
    """``names`` (layout names, ``onnx`` for ``DEFAULT_LAYOUTS``) in their canonical spelling."""
    out: list[str] = []
    for name in names:
        out.extend(DEFAULT_LAYOUTS if name == ALIAS else (parse_layout(name).name,))
    return tuple(out)


def layout_of(spec) -> Layout | None:
    """The layout a uniform ``spec`` is (None: no MatMulNBits layout, e.g. a llama.cpp grid or 3-bit codes)."""
    if not isinstance(spec, QuantSpec) or spec.bits not in (4, 8) or spec.group_size not in BLOCKS:
        return None
    return Layout(spec.bits, spec.group_size, spec.symmetric)
