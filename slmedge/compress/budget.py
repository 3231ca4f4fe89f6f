"""Mixed grids to a size budget: each linear's llama.cpp grid chosen from measured sensitivity.

``Recipe.bpw`` asks for an average number of bits per weight over the compressed linears, as GGUF
stores them (codes, scales, mins and sub-block codes: ``Grid.bits_per_weight``; a linear's rows
that a grid's super-blocks do not divide count at llama.cpp's fallback grid). Before the first
block is compressed, one pass over the calibration data measures, for every linear and every grid
it can take, how much of its output the grid's rounding loses: the importance-weighted error of
the grid's fit (``grid_fit.fit``, weighing by the input channels' mean squares) relative to the
importance-weighted energy of the weight, ``sum_j imp_j |W_j - Q_j|^2 / sum_j imp_j |W_j|^2``: the
noise-to-signal ratio of the layer's output under independent inputs (measured on a subset of rows,
every k-th, at most ``SENSITIVITY_ROWS``, which the ratio does not depend on in expectation). Each
linear's ratios are then weighted by how much of its block's output (the residual stream) its output
moves (``engine.output_reach``), so that the weighted ratio is the relative error of the residual
stream the grid causes there: a ratio alone counts a key projection behind a softmax as much as a
down projection added to the stream as it is. The choice of one grid per linear that minimises the
sum of the weighted ratios with the total within [1 - tolerance, 1] of the budget is then dynamic
programming over the linears (sizes in steps of 1/100,000 of the budget; the true total of the
chosen end state is checked).

The same budget for ONNX: when the choices (``Recipe.bpw_grids``) name onnxruntime's MatMulNBits
layouts (``compress.layouts``: int4/int8 at a block size, with or without zero points), sizes are
counted as the ONNX file stores them, a layout is offered only where its block divides the rows, and
a layout's error is that of its min/max rounding (what GPTQ and AWQ then improve on, as they do on
llama.cpp's grids); the chosen layout's ``QuantSpec`` is what the method rounds onto.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import ConfigError
from ..models.grids import GRIDS, Grid, grid_for_width
from .grid_fit import fit
from .layouts import Layout, is_layout_name, parse_layout
from .quant import quantize_groups

TOLERANCE = 0.01  # the allocation lands within 1% below the budget
UNITS = 100_000  # the budget's resolution in the allocation
SENSITIVITY_ROWS = 256  # rows of each weight its sensitivity is measured on


def on_layouts(names) -> bool:
    """Whether the choices ``names`` are ONNX layouts (``compress.layouts``) rather than llama.cpp's grids."""
    return bool(names) and all(is_layout_name(n) for n in names)


def choice(name: str) -> Grid | Layout:
    """The grid or layout a budget's choice ``name`` is."""
    return parse_layout(name) if is_layout_name(name) else GRIDS[name]


def candidates(columns: int, names=None) -> list[Grid | Layout]:
    """What a linear ``columns`` wide can be written in, by size: each of ``names`` (all of llama.cpp's
    grids when None), a grid as itself or llama.cpp's fallback for the width, a layout where its block
    divides the width (none of them may)."""
    if on_layouts(names):
        found = [layout for layout in map(parse_layout, names) if layout.why_not(columns) is None]
        return sorted(found, key=lambda lay: (lay.bits_per_weight(columns), lay.name))
    found = {}
    for name in (names or GRIDS):
        grid = grid_for_width(name, columns)
        found[grid.name] = grid
    return sorted(found.values(), key=lambda g: (g.bits_per_weight, g.name))


def linear_bits(rows: int, columns: int, grid: Grid | Layout) -> int:
    """Bits of a (rows, columns) linear as the file stores it: GGUF blocks, or MatMulNBits' tensors."""
    if isinstance(grid, Layout):
        return grid.linear_bits(rows, columns)
    return rows * columns * grid.type_size * 8 // grid.block


def check_budget(shapes: dict[str, tuple[int, int]], bpw: float, names=None) -> None:
    """Refuse (ConfigError) a budget no choice of grids (``names``, all when None) reaches within the
    tolerance, before any work."""
    grids = f"the grids {', '.join(names)}" if names else "llama.cpp's grids"
    if on_layouts(names):
        grids = f"the ONNX layouts {', '.join(names)}"
        for name, (_, c) in shapes.items():
            if not candidates(c, names):
                raise ConfigError(f"{name}: none of {grids} fits its {c}-wide rows (a layout's block size must "
                                  f"divide them)")
    total = sum(r * c for r, c in shapes.values())
    lo = sum(linear_bits(r, c, candidates(c, names)[0]) for r, c in shapes.values())
    hi = sum(linear_bits(r, c, candidates(c, names)[-1]) for r, c in shapes.values())
    if bpw * total < lo:
        raise ConfigError(f"bpw {bpw:g} is below what {grids} can reach on these linears: at least "
                          f"{lo / total:.4f} (every linear on its smallest grid)")
    if bpw * total * (1 - TOLERANCE) > hi:
        raise ConfigError(f"bpw {bpw:g} is above what {grids} can use on these linears: at most "
                          f"{hi / total:.4f} (every linear on its largest grid)")
    zero = {name: {g.name: 0.0 for g in candidates(c, names)} for name, (r, c) in shapes.items()}
    if allocate(shapes, zero, bpw) is None:
        raise ConfigError(f"no choice of {grids} for these linears lands within {TOLERANCE:.0%} below "
                          f"bpw {bpw:g}; try another budget")


@torch.no_grad()
def sensitivity(weight: torch.Tensor, importance: torch.Tensor | None, grids: list, weighted_fit: bool = True,
                max_rows: int = SENSITIVITY_ROWS) -> dict[str, float]:
    """Grid name -> noise-to-signal ratio of the layer's output when ``weight`` (rows, cols) is fitted on
    it: ``sum imp (W - Q)^2 / sum imp W^2`` over a subset of rows (``importance`` None: plain squares).
    An ONNX layout's fit is its min/max rounding (``quantize_groups``)."""
    w = weight.float()
    if w.shape[0] > max_rows:
        w = w[torch.linspace(0, w.shape[0] - 1, max_rows).round().long()]
    imp = torch.ones(w.shape[1]) if importance is None else importance.float().cpu()
    w = w.cpu()
    signal = float((w * w * imp).sum())
    out = {}
    for grid in grids:
        if isinstance(grid, Layout):
            q = quantize_groups(w, grid.spec)[0]
        else:
            q = fit(grid, w, imp if (weighted_fit and importance is not None) else None).weight
        err = float(((w - q) ** 2 * imp).sum())
        out[grid.name] = err / signal if signal > 0 else 0.0
    return out


def allocate(shapes: dict[str, tuple[int, int]], errors: dict[str, dict[str, float]], bpw: float) -> dict[str, str] | None:
    """The grid per linear minimising the summed ``errors`` with the total bits within [1 - TOLERANCE, 1] of
    ``bpw`` times the weights (None when no choice is). Exact dynamic programming over the linears with
    the budget in ``UNITS`` steps (each linear's bits rounded to the nearest step); the end states are then
    taken from the least error up until one whose true total is in the window."""
    names = list(shapes)
    total = sum(r * c for r, c in shapes.values())
    budget = bpw * total
    unit = budget / UNITS
    size = UNITS + len(names) + 1  # rounding moves a total by under half a step per linear
    options = []
    for name in names:
        rows, cols = shapes[name]
        opts = [(g.name, linear_bits(rows, cols, g), float(errors[name][g.name]))
                for g in candidates(cols, list(errors[name]))]
        options.append([(g, bits, err, round(bits / unit)) for g, bits, err in opts])
    best = np.full(size, np.inf)
    best[0] = 0.0
    choices = np.full((len(names), size), -1, dtype=np.int8)
    for i, opts in enumerate(options):
        new = np.full(size, np.inf)
        for k, (_, _, err, cost) in enumerate(opts):
            if cost >= size:
                continue
            cand = best[: size - cost] + err
            better = cand < new[cost:]
            new[cost:][better] = cand[better]
            choices[i, cost:][better] = k
        best = new
    low = max(0, math.floor((1 - TOLERANCE) * UNITS) - len(names))
    ends = [c for c in np.argsort(best[low:], kind="stable") + low if np.isfinite(best[c])]
    for c in ends:
        picked, state = {}, int(c)
        for i in range(len(names) - 1, -1, -1):
            g, _, _, cost = options[i][int(choices[i, state])]
            picked[names[i]] = g
            state -= cost
        used = sum(linear_bits(*shapes[n], choice(picked[n])) for n in names)
        if (1 - TOLERANCE) * budget <= used <= budget:
            return {n: picked[n] for n in names}
    return None
