"""The sparsity setting, parsed once: a ratio (``0.5``) or N:M (``2:4``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import ConfigError
from ..limits import check

_NM = re.compile(r"(\d+)\s*:\s*(\d+)")


@dataclass(frozen=True)
class Sparsity:
    """Unstructured ``ratio`` of weights dropped, or N:M (``n`` zeros in every ``m`` consecutive
    weights of a row; ``ratio`` is then n/m). Valid by construction: every way of making one
    checks it."""

    ratio: float
    n: int | None = None
    m: int | None = None

    def __post_init__(self):
        if self.n is not None or self.m is not None:
            n, m = self.n, self.m
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in (n, m)):
                raise ConfigError(f"N:M sparsity needs two integers N and M, got n={n!r}, m={m!r}")
            if m < 2 or n < 1 or n >= m:
                raise ConfigError(f"N:M sparsity needs 1 <= N < M (N zeros in every M weights), got {n}:{m}")
            check("sparsity_m", m, f"M of the N:M sparsity {n}:{m}")
            object.__setattr__(self, "ratio", n / m)
            return
        r = self.ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)):
            raise ConfigError(f"sparsity must be a ratio in [0, 1) or N:M such as 2:4, got {r!r}")
        if not (math.isfinite(r) and 0 <= r < 1):
            raise ConfigError(f"sparsity must be at least 0 and below 1, got {r:g}")
        object.__setattr__(self, "ratio", float(r))

    @property
    def is_nm(self) -> bool:
        """N:M (semi-structured) rather than an unstructured ratio."""
        return self.n is not None

    def describe(self) -> str:
        """``n:m``, or the ratio as ``0.5`` (``%g``, or every digit where that would round it):
        ``parse(describe())`` gives the same value back."""
        if self.is_nm:
            return f"{self.n}:{self.m}"
        short = f"{self.ratio:g}"
        return short if float(short) == self.ratio else repr(self.ratio)

    def __str__(self) -> str:
        return self.describe()

    @classmethod
    def parse(cls, value) -> "Sparsity":
        """From a Sparsity, a number (``0.5``) or text (``"0.5"``, ``"2:4"``); ConfigError says why not."""
        if isinstance(value, Sparsity):
            return value
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ConfigError(f"sparsity must be a ratio in [0, 1) or N:M such as 2:4, got {value!r}")
        if isinstance(value, (int, float)):
            return cls(float(value))
        text = value.strip()
        match = _NM.fullmatch(text)
        if match:
            return cls(0.0, int(match.group(1)), int(match.group(2)))
        try:
            ratio = float(text)
        except ValueError:
            raise ConfigError(f"sparsity must be a ratio in [0, 1) or N:M such as 2:4, got '{text}'") from None
        return cls(ratio)
