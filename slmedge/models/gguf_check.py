"""Check transformers' import of a GGUF file against llama.cpp on the same file.

transformers dequantizes GGUF tensors into a torch model; llama.cpp runs the file itself. If
the two disagree on a short probe, the import is wrong (transformers' Gemma 3 tokenizer was,
until slmedge rebuilt it) and nothing built on it can be trusted, so slmedge refuses it.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..errors import GGUFImportMismatchError
from ..backends.llamacpp import quiet_native_stderr, vocab_only  # noqa: F401 - re-exported

PROBE = (
    "The quick brown fox jumps over the lazy dog. In 1969, astronauts first walked on the Moon, "
    "and the photographs they took are still studied today. Die Katze schläft auf dem Sofa, "
    "während es draußen regnet. def add(a, b):\n    return a + b\n"
)

# llama.cpp multiplies quantized weights with 8-bit-quantized activations while transformers
# uses the dequantized fp32 weights, so a correct import still differs a little (SmolLM2 Q4_1:
# mean KL 5e-3, top-1 agreement 97% on the probe, measured here). A wrong import is off by orders of
# magnitude (transformers' Gemma 3 tokenizer before models/gguf_tokenizer.py: perplexity 101
# against llama.cpp's 23).
MAX_MEAN_KL = 0.05
MIN_TOP1 = 0.85


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare_logits(reference: np.ndarray, candidate: np.ndarray) -> dict:
    """KL(reference || candidate) per position, top-1 agreement; (T, V) float arrays."""
    lp = log_softmax(reference.astype(np.float64))
    lq = log_softmax(candidate.astype(np.float64))
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    top1 = (reference.argmax(-1) == candidate.argmax(-1)).mean()
    return {
        "mean_kl": float(kl.mean()),
        "max_kl": float(kl.max()),
        "top1_agreement": float(top1),
        "max_abs_logit_diff": float(np.abs(reference - candidate).max()),
        "positions": int(reference.shape[0]),
    }


def llamacpp_logits(gguf_path, token_ids: list[int], n_threads: int | None = None) -> np.ndarray:
    from ..backends.llamacpp import load_llama
    from ..procs import native

    with native("llama.cpp", gguf_path):
        return _logits(load_llama, gguf_path, token_ids, n_threads)


def _logits(load_llama, gguf_path, token_ids: list[int], n_threads: int | None) -> np.ndarray:
    with quiet_native_stderr():
        llm = load_llama(
            gguf_path,
            n_ctx=max(64, len(token_ids) + 8),
            n_batch=max(64, len(token_ids) + 8),
            logits_all=True,
            verbose=False,
            n_threads=n_threads or max(1, os.cpu_count() or 1),
        )
    try:
        llm.eval(token_ids)
        return np.array(llm.scores[: len(token_ids)], dtype=np.float32)
    finally:
        llm.close()


def check_against_llamacpp(model, tokenizer, gguf_path, text: str = PROBE) -> dict:
    """Compare logits on ``text``; raise :class:`GGUFImportMismatchError` when they disagree."""
    from ..data.calibration import adds_bos
    from .gguf_tokenizer import TOKENIZER_PROBE

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with vocab_only(gguf_path) as llm:
        for probe in (text, TOKENIZER_PROBE):  # the logits probe, then one made to trip tokenizers
            mine = tokenizer(probe, add_special_tokens=False)["input_ids"]
            theirs = llm.tokenize(probe.encode("utf-8"), add_bos=False, special=False)
            if list(theirs) != list(mine):
                first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
                raise GGUFImportMismatchError(
                    f"transformers and llama.cpp tokenize {os.path.basename(str(gguf_path))} differently "
                    f"(first difference at token {first} of {probe[:24]!r}...); its import cannot be trusted"
                )
    # Logits on what the model is given in use: with BOS when the file says to add it. (Gemma 3
    # without its BOS has no attention sink, and the two runtimes' small rounding differences
    # grow: mean KL 0.086 on this probe against 0.010 with it.)
    if adds_bos(tokenizer):
        ids = [tokenizer.bos_token_id] + list(ids)
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0].float().numpy()
    cpp = llamacpp_logits(gguf_path, ids)
    stats = compare_logits(cpp, hf)
    if stats["mean_kl"] > MAX_MEAN_KL or stats["top1_agreement"] < MIN_TOP1:
        raise GGUFImportMismatchError(
            f"transformers' import of {os.path.basename(str(gguf_path))} disagrees with llama.cpp on the same file "
            f"(mean KL {stats['mean_kl']:.3f} > {MAX_MEAN_KL} or top-1 agreement {stats['top1_agreement']:.0%} "
            f"< {MIN_TOP1:.0%}); refusing to build on a wrong import"
        )
    return stats
