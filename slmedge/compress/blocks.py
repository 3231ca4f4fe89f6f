"""A decoder block's calibration inputs and one forward of it: what the engine and the
block-level methods (AWQ) share, below both."""

from __future__ import annotations

import torch


def run_block(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


class BlockInputs:
    """Hidden states entering the current block, per batch, and each block's call kwargs.

    Keyword arguments (rotary embeddings, attention masks) can differ between blocks (Gemma's
    sliding-window layers get another mask), so they are captured for every block from one
    full forward per distinct batch size, then reused for all batches of that size.
    """

    def __init__(self, hidden: list[torch.Tensor], kwargs: dict[tuple[int, int], dict]):
        self.hidden = hidden
        self._kwargs = kwargs

    def kwargs(self, layer_index: int, batch: torch.Tensor) -> dict:
        return self._kwargs[(layer_index, batch.shape[0])]

    def __len__(self):
        return len(self.hidden)
