"""What a compression method is, and the one registry that names them."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ...errors import ConfigError
from ...models.grids import Grid, grid_for_width
from ..quant import QuantSpec, quantize_any


@dataclass
class LinearResult:
    """The compressed form of one linear layer.

    ``weight`` is the final dense weight (dequantized codes, pruned zeros), exactly what the
    artifact's HF weights hold. ``codes`` are set for quantized layers (uint8 (out, in)): on the
    uniform grid (``spec`` a QuantSpec) with ``scales``/``zeros`` (fp16 / uint8 (out, G)), on one of
    llama.cpp's (``spec`` a models.grids.Grid) with ``fields`` (its fp16 scales and integer sub-block
    codes, ``Grid.fields``); ``perm`` is the column order GPTQ's act-order used; ``mask`` (bool
    (out, in), True = kept) for pruned layers.
    """

    weight: torch.Tensor
    spec: QuantSpec | Grid | None = None
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    fields: dict | None = None


class HessianStats:
    """GPTQ/SparseGPT's H = 2/n sum x x^T over calibration tokens, kept as a running mean."""

    def importance(self) -> torch.Tensor:
        """Each input channel's mean square over the tokens (diag H / 2): an importance matrix's row."""
        return torch.diagonal(self.H) / 2

    def __init__(self, columns: int, device):
        self.H = torch.zeros(columns, columns, device=device, dtype=torch.float32)
        self.nsamples = 0
        # What the methods derive from H alone (the Cholesky factor of H^-1, act-order's
        # permutation), by setting: linears sharing these statistics (q/k/v) compute it once.
        self.plans: dict = {}

    @staticmethod
    def bytes_for(columns: int) -> int:
        """Memory of the statistics of a ``columns``-wide input: H, and the factor derived from it."""
        return 2 * 4 * columns * columns

    def add_batch(self, inp: torch.Tensor) -> None:
        x = inp.reshape(-1, inp.shape[-1]).float()  # (tokens, in)
        tmp = x.shape[0]
        self.plans.clear()
        self.H *= self.nsamples / (self.nsamples + tmp)
        self.nsamples += tmp
        c = (2 / self.nsamples) ** 0.5
        # One thread: torch's CPU matmul gives the same bits on one thread as on two, and under
        # any other load on two cores the second thread's barriers cost more than it computes.
        with single_thread():
            add_gram(self.H, [c * x[:, a:b] for a, b in _column_blocks(x.shape[1])])


# Column blocks of about this width for the Gram matrix x^T x (see add_gram).
GRAM_BLOCK = 384


def _column_blocks(columns: int) -> list[tuple[int, int]]:
    n = max(1, round(columns / GRAM_BLOCK))
    edges = [round(columns * i / n) for i in range(n + 1)]
    return list(zip(edges[:-1], edges[1:]))


def add_gram(H: torch.Tensor, blocks: list[torch.Tensor]) -> None:
    """``H += x^T x`` for ``x`` given as contiguous column blocks, the upper blocks only.

    x^T x is symmetric: computing the blocks on and above the diagonal and mirroring them does
    (n + 1) / 2n of the multiply-adds (0.62 for SmolLM2's 1536-wide down_proj input, the largest
    Hessian). Each block is the same dot products over the same tokens as the full product;
    with torch's CPU BLAS every element comes out bit for bit as ``x.t() @ x`` does (measured
    for 576- and 1536-wide inputs, 4096 tokens, 1 and 2 threads).
    """
    edges = [0]
    for blk in blocks:
        edges.append(edges[-1] + blk.shape[1])
    for a, xa in enumerate(blocks):
        sa = slice(edges[a], edges[a + 1])
        for b in range(a, len(blocks)):
            sb = slice(edges[b], edges[b + 1])
            prod = xa.t() @ blocks[b]
            H[sa, sb] += prod
            if b > a:
                H[sb, sa] += prod.t()


class InputNormStats:
    """Wanda's squared L2 norm of each input feature over calibration tokens, averaged: each input
    channel's mean square, what an importance matrix holds (RTN's importance-weighted rounding)."""

    def importance(self) -> torch.Tensor:
        return self.scaler_row

    def __init__(self, columns: int, device):
        self.scaler_row = torch.zeros(columns, device=device, dtype=torch.float32)
        self.nsamples = 0

    @staticmethod
    def bytes_for(columns: int) -> int:
        return 4 * columns

    def add_batch(self, inp: torch.Tensor) -> None:
        x = inp.reshape(-1, inp.shape[-1]).float()
        tmp = x.shape[0]
        self.scaler_row *= self.nsamples / (self.nsamples + tmp)
        self.nsamples += tmp
        with single_thread():  # see single_thread
            self.scaler_row += x.pow(2).sum(dim=0) / self.nsamples


def cores_shared() -> bool:
    """Whether other work competes for the CPU: the 1-minute load average above the core count
    (this process's own threads count once each, so it alone stays at or below it)."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1) + 0.5
    except OSError:
        return False


@contextlib.contextmanager
def single_thread(always: bool = False) -> Iterator[None]:
    """Run torch's CPU ops on one thread inside the block (restored after), when the cores are shared.

    For loops of many small operations (GPTQ's and SparseGPT's columns, a few thousand floats
    each): torch splits anything above ~32k elements across its OpenMP threads, and each split
    ends at a barrier; with another process on the cores the barrier waits a scheduler slice, and
    one thread is several times faster. Alone on the machine, though, the threads pay: measured on
    these 2 cores, quiet, the first 4 AWQ blocks of SmolLM2 took 44.8 s on one thread and 36.4 s on
    two, 3 GPTQ blocks 38.2 s and 31.2 s. So one thread only while ``cores_shared()``; ``always``
    for what must not depend on the thread count (LAPACK's Cholesky inverse gives other low bits on
    two threads). Elsewhere the results are the same bits on any thread count.
    """
    before = torch.get_num_threads()
    if before == 1 or not (always or cores_shared()):
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Method:
    """A compression method. The engine owns the hooks, the block order and the device.

    A per-linear method says which statistics of a layer's inputs it needs (``stats_class``,
    None for data-free methods) and how to compress one weight (``compress``). A block-level
    method (``block_level = True``, AWQ) instead compresses a whole decoder block at once from
    its calibration inputs (``compress_block``); it always reads calibration data and cannot
    compress ``lm_head`` (no block around it).
    """

    name: str = ""
    kind: str = "quantize"  # "quantize" | "prune"
    stats_class: type | None = None
    summary: str = ""
    true_sequential: bool = True  # the reference implementation's default (see Recipe)
    block_level: bool = False  # compresses whole blocks (compress_block), not one linear at a time
    settings: tuple[str, ...] = ()  # the recipe's method-specific settings it reads (Recipe.applied)

    def __init__(self, recipe):
        self.recipe = recipe
        self.spec = recipe.quant_spec()  # the uniform grid (None on llama.cpp's grids: spec_for)
        self.quantizes = recipe.quantizes
        self.sparsity = recipe.sparsity  # a Sparsity, parsed when the recipe was made, or None
        # A bits-per-weight budget's grid per linear (compress.budget), set before the first block.
        self.assigned: dict[str, Grid] = {}

    def spec_for(self, name: str, columns: int):
        """The grid linear ``name`` (``columns`` inputs wide) is quantized on: its budget's, the recipe's
        llama.cpp grid (or llama.cpp's fallback for this width), or the uniform grid."""
        if name in self.assigned:
            return self.assigned[name]
        if self.recipe.grid is not None:
            return grid_for_width(self.recipe.grid, columns)
        if self.recipe.bpw is not None:
            raise RuntimeError(f"no grid was assigned to {name} (the budget's allocation runs before the first block)")
        return self.spec

    def weighs_by(self, stats) -> torch.Tensor | None:
        """The input channels' mean squares the grid's scale search weighs by: from ``stats`` unless the
        recipe turned importance off."""
        if stats is None or self.recipe.importance is False:
            return None
        return stats.importance()

    @property
    def needs_calibration(self) -> bool:
        """Whether the method reads calibration data: a block-level method always does, and any method
        given a bits-per-weight budget (its grids are chosen from measured sensitivity)."""
        return self.block_level or self.stats_class is not None or self.recipe.bpw is not None

    def resolve(self, device: torch.device) -> dict:
        """Fix, before the first block, what the recipe leaves to the device (an "auto" setting);
        returns the values chosen, which the artifact's manifest records (``resolved``)."""
        return {}

    def compress(self, name: str, weight: torch.Tensor, stats) -> LinearResult:
        raise NotImplementedError

    def compress_shared(self, weights: dict[str, torch.Tensor], stats) -> dict[str, LinearResult]:
        """Compress the linears fed the very same input, which share one statistics object
        (q/k/v, gate/up): ``{name: weight}`` -> ``{name: LinearResult}``. One at a time here; a
        method whose rows are independent given the statistics may do them in one go (GPTQ)."""
        return {name: self.compress(name, weight, stats) for name, weight in weights.items()}

    def compress_block(self, layer, prefix: str, linears: dict, inputs, layer_index: int, arch) -> tuple[dict, dict]:
        """A block-level method's work on one block: ``({linear name: LinearResult}, extras)``."""
        raise NotImplementedError(f"{self.name} is not a block-level method")


def rtn_result(weight: torch.Tensor, spec, mask: torch.Tensor | None = None, clip=None,
               overwrite: bool = False, importance: torch.Tensor | None = None) -> LinearResult:
    """Round-to-nearest of ``weight`` on ``spec`` (the uniform grid or a llama.cpp one, whose scales are
    searched weighing each column by ``importance``); pruned zeros stay exactly zero (zero is on the
    grid). ``overwrite``: ``weight`` may be rounded in its own storage (``quantize_groups``)."""
    with single_thread():  # elementwise work on one weight: see single_thread
        deq, codes, scales, zeros, fields = quantize_any(weight, spec, clip=clip, importance=importance,
                                                          overwrite=overwrite)
    return LinearResult(deq, spec, codes, scales, zeros, mask=mask, fields=fields)


@dataclass(frozen=True)
class MethodInfo:
    name: str
    cls: type
    kind: str
    summary: str


METHODS: dict[str, MethodInfo] = {}


def register_method(name: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        if name in METHODS:
            raise ValueError(f"method '{name}' registered twice")
        cls.name = name
        METHODS[name] = MethodInfo(name, cls, cls.kind, cls.summary)
        return cls

    return wrap


def get_method(name: str) -> MethodInfo:
    if name not in METHODS:
        raise ConfigError(f"unknown method '{name}'; choose one of: {', '.join(METHODS)}")
    return METHODS[name]
