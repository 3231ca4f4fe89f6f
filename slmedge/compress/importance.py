"""Importance statistics: each linear's squared inputs summed per input column over calibration text.

This is what llama.cpp's importance matrix holds (``llama-imatrix``: per weight tensor, ``in_sum2``
the sum over tokens of x_j^2 for every input column j, and ``counts`` the number of tokens), and
what its quantizer weights each column's rounding error with (``llama-quantize --imatrix``, which
divides the two). slmedge computes it on the model's own forward pass in fp32, one block at a time,
with the same calibration windows a compression uses (``compress.engine``'s capture and hooks), so
a llama.cpp user can take slmedge's calibration without its methods (``export.imatrix`` writes it in
llama.cpp's file format).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..models.architectures import Architecture
from .engine import (_move_outside_layers, _to_compute, block_linears, capture_inputs, collect_stats,
                     resolve_device, run_block)


@dataclass
class Importance:
    """One linear's statistics: ``sum2`` (float64, one per input column) and ``count`` (tokens)."""

    sum2: torch.Tensor
    count: int

    @property
    def mean(self) -> torch.Tensor:
        """The mean squared input per column (what llama.cpp's quantizer weights errors by)."""
        return self.sum2 / max(1, self.count)


class SquareStats:
    """Running sum of x^2 per input column (float64) and the number of tokens seen."""

    def __init__(self, columns: int, device):
        self.sum2 = torch.zeros(columns, dtype=torch.float64, device=device)
        self.count = 0

    def add_batch(self, inp: torch.Tensor) -> None:
        x = inp.reshape(-1, inp.shape[-1]).double()
        self.sum2 += (x * x).sum(dim=0)
        self.count += x.shape[0]


def importance_stats(model, arch: Architecture, calibration: torch.Tensor, device="cpu", batch_size: int = 8,
                     skip=("lm_head",), progress=None) -> tuple[dict[str, Importance], dict]:
    """``{linear name: Importance}`` of every decoder-block linear of ``model`` (its weights unchanged)
    over ``calibration`` ((nsamples, seqlen) token ids), and timings. The blocks are computed in fp32,
    one at a time, each fed the previous block's outputs (as the model's own forward pass would);
    linears fed the same tensor (q/k/v, gate/up) get equal statistics. The model is consumed: each
    finished block is moved to the meta device."""
    device = resolve_device(device) if not isinstance(device, torch.device) else device
    started = time.perf_counter()
    _move_outside_layers(model, arch.layers, device, torch.float32)
    batches = list(torch.split(calibration, batch_size))
    inputs = capture_inputs(model, arch, batches, device)
    layers = model.get_submodule(arch.layers)
    found: dict[str, Importance] = {}
    with torch.no_grad():
        for idx, layer in enumerate(layers):
            _to_compute(layer, device)
            linears = block_linears(layer, arch, f"{arch.layers}.{idx}", skip)
            stats = collect_stats(layer, idx, linears, inputs, SquareStats, device, shared_stop=False)
            for name in linears:
                st = stats[name]
                found[name] = Importance(st.sum2.detach().cpu().clone(), int(st.count))
            if idx < len(layers) - 1:
                for i, h in enumerate(inputs.hidden):
                    inputs.hidden[i] = run_block(layer, h, inputs.kwargs(idx, h))
            layer.to("meta")
            if progress:
                progress("block", idx + 1, len(layers))
    return found, {"importance_s": time.perf_counter() - started}
