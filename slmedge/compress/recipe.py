"""The compression recipe: one strict, typed description of what to do, saved with the artifact."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields

from ..errors import ConfigError
from .quant import QuantSpec

DEFAULT_SKIP = ("lm_head", "*embed_tokens*")


@dataclass(frozen=True)
class Sparsity:
    """Unstructured ratio, or N:M (N zeros in every M consecutive weights of a row)."""

    ratio: float
    n: int | None = None
    m: int | None = None

    @property
    def structured(self) -> bool:
        return self.n is not None

    def describe(self) -> str:
        return f"{self.n}:{self.m}" if self.structured else f"{self.ratio:g}"

    @classmethod
    def parse(cls, value) -> "Sparsity":
        if isinstance(value, Sparsity):
            return value
        text = str(value).strip()
        match = re.fullmatch(r"(\d+)\s*:\s*(\d+)", text)
        if match:
            n, m = int(match.group(1)), int(match.group(2))
            if m < 2 or n < 1 or n >= m:
                raise ConfigError(f"N:M sparsity needs 1 <= N < M (N zeros in every M weights), got {n}:{m}")
            return cls(n / m, n, m)
        try:
            ratio = float(text)
        except ValueError:
            raise ConfigError(f"sparsity must be a ratio in [0, 1) or N:M such as 2:4, got '{text}'") from None
        if not 0 <= ratio < 1:
            raise ConfigError(f"sparsity must be at least 0 and below 1, got {ratio:g}")
        return cls(ratio)


@dataclass
class Recipe:
    method: str = "awq"
    # Quantization; bits=None means "do not quantize" (pruning methods alone).
    bits: int | None = 4
    group_size: int = 128
    symmetric: bool = False
    # Pruning.
    sparsity: str | None = None
    # Calibration.
    calibration: str = "c4"
    nsamples: int = 128
    seqlen: int = 512
    seed: int = 0
    batch_size: int = 8  # calibration samples per block forward; bounds activation memory
    # Which linears are left alone (fnmatch patterns on module names).
    skip: tuple[str, ...] = DEFAULT_SKIP
    # GPTQ / SparseGPT.
    damp: float = 0.01  # fraction of mean(diag H) added to the diagonal (the papers' percdamp)
    block_size: int = 128  # columns processed together; the error is propagated lazily between blocks
    act_order: bool = True  # quantize columns by decreasing Hessian diagonal, with static groups
    # Statistics of later linears see the already-compressed earlier ones. None: the method's
    # reference behaviour (GPTQ, SparseGPT: on; Wanda: off, one pass per block).
    true_sequential: bool | None = None
    # AWQ.
    awq_grid: int = 20  # points of the scale-exponent grid in [0, 1)
    awq_clip: bool = True  # search a clipping ratio per group after scaling
    awq_max_tokens: int = 2048  # tokens the search losses use; SmolLM2 W4g64: 2048 -> ppl 29.72, 8192 -> 29.70 at 2.2x the time
    extra: dict = field(default_factory=dict)

    def quant_spec(self) -> QuantSpec | None:
        if self.bits is None:
            return None
        return QuantSpec(self.bits, self.group_size, self.symmetric)

    def sparsity_spec(self) -> Sparsity | None:
        return None if self.sparsity is None else Sparsity.parse(self.sparsity)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["skip"] = list(self.skip)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Recipe":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown recipe keys: {', '.join(unknown)}")
        data = dict(data)
        if "skip" in data:
            data["skip"] = tuple(data["skip"])
        return cls(**data)

    def validate(self) -> "Recipe":
        """Check every setting before any work starts; raise ConfigError with the reason."""
        from .methods import METHODS, get_method

        info = get_method(self.method)
        if self.bits is not None:
            if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
                raise ConfigError(f"bits must be an integer from 2 to 8, got {self.bits}")
            self.quant_spec()
        spars = self.sparsity_spec()
        if info.kind == "quantize":
            if spars is not None and spars.ratio > 0:
                pruners = ", ".join(k for k, v in METHODS.items() if v.kind == "prune")
                raise ConfigError(f"{self.method} quantizes and does not prune; for sparsity use one of: {pruners}")
            if self.bits is None:
                raise ConfigError(f"{self.method} needs a bit width (--bits 2..8)")
        else:
            if spars is None:
                raise ConfigError(f"{self.method} prunes: give --sparsity (a ratio such as 0.5, or N:M such as 2:4)")
        for name, value, lo in (("nsamples", self.nsamples, 1), ("seqlen", self.seqlen, 8), ("batch_size", self.batch_size, 1),
                                ("block_size", self.block_size, 1), ("awq_grid", self.awq_grid, 1), ("awq_max_tokens", self.awq_max_tokens, 16)):
            if not isinstance(value, int) or value < lo:
                raise ConfigError(f"{name} must be an integer of at least {lo}, got {value}")
        if not 0 <= self.damp < 1:
            raise ConfigError(f"damp must be in [0, 1), got {self.damp}")
        return self

    def describe(self) -> str:
        parts = [self.method]
        if self.bits is not None:
            parts.append(self.quant_spec().describe())
        if self.sparsity is not None:
            parts.append(f"sparsity {self.sparsity_spec().describe()}")
        return " ".join(parts)
