"""Every exporter checks what it wrote before keeping it, the same way: a short probe is run
through the export's runtime and through torch on the source's own (dequantized) weights, the
logits are compared (top-1 agreement, max |Δlogit|, mean KL) and over the format's tolerance
for the kind of file (a type, codes kept, re-quantized...) a :class:`ExportVerificationError`
(the format's subclass) is raised; the exporter then leaves nothing at the output path."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

from ..models.architectures import exact_attention
from .errors import ExportVerificationError


def probe_text(probe: str | None = None) -> str:
    """The text the export is checked on (the same probe as the GGUF import check)."""
    from ..models.gguf_check import PROBE

    return PROBE if probe is None else probe


def source_tokenizer(path: Path):
    """The source folder's tokenizer, as transformers loads it for the model."""
    from transformers import AutoTokenizer

    from ..models.source import tokenizer_kwargs

    return AutoTokenizer.from_pretrained(str(path), **tokenizer_kwargs(path))


def torch_model(path: Path, dtype=None):
    """The fp32 (or ``dtype``) torch model of an export's source: an HF folder, or an artifact (a
    compact one's weights rebuilt from its codes)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..models.artifact_format import is_artifact, is_compact

    dtype = torch.float32 if dtype is None else dtype
    if is_artifact(path) and is_compact(path):
        from ..models.artifact_weights import load_model

        return load_model(path, dtype)
    return exact_attention(AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype))


def torch_logits(path: Path, ids: list[int]) -> np.ndarray:
    """torch's fp32 logits (positions, vocab) of the source folder's weights for ``ids``: the model's own
    forward pass with one decoder block in memory at a time (``models.streamed``), equal to the whole
    fp32 model's logits without the whole fp32 model (15 GB for a 3.8B one)."""
    import torch

    from ..models.streamed import streamed_logits

    return streamed_logits(path, torch.tensor([list(ids)], dtype=torch.long))[0].numpy()


def compare_logits(reference: np.ndarray, candidate: np.ndarray) -> dict:
    """mean_kl and max_kl (KL of the candidate from the reference), top1_agreement, max_abs_logit_diff, positions."""
    from ..models.gguf_check import compare_logits as compare

    return compare(reference, candidate)


def within(stats: Mapping, tolerance: Mapping[str, float]) -> bool:
    """Whether compared logits are inside a tolerance (``mean_kl`` at most, ``top1`` agreement at least)."""
    return not (stats["mean_kl"] > tolerance["mean_kl"] or stats["top1_agreement"] < tolerance["top1"])


def check_logits(reference: np.ndarray, candidate: np.ndarray, tolerance: Mapping[str, float], disagree: str,
                 error: type = ExportVerificationError, **extra) -> dict:
    """Compare the export's logits with torch's; over ``tolerance`` raise ``error`` ("``disagree`` (mean
    KL ... or top-1 agreement ...); nothing was written"). Returns the statistics, then ``extra``, then
    the tolerance applied."""
    stats = compare_logits(reference, candidate)
    stats.update(extra)
    stats["tolerance"] = dict(tolerance)
    if not within(stats, tolerance):
        raise error(f"{disagree} (mean KL {stats['mean_kl']:.2e} > {tolerance['mean_kl']:g} or top-1 agreement "
                    f"{stats['top1_agreement']:.0%} < {tolerance['top1']:.0%}); nothing was written")
    return stats
