"""Perplexity and bits per byte over non-overlapping windows, in torch.

Each window of ``seqlen`` tokens predicts its tokens 2..seqlen from the ones before; the last
partial window is dropped. PPL = exp(mean NLL over predicted tokens). Bits per byte = total
NLL / ln 2 / the UTF-8 bytes of the text those predicted tokens cover, which makes languages
and tokenizers comparable.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..errors import DataError


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float  # mean NLL per token, nats
    nll_stderr: float
    perplexity_stderr: float
    bits_per_byte: float
    tokens: int
    bytes: int
    windows: int
    seqlen: int

    def to_dict(self) -> dict:
        return asdict(self)


def windows_of(tokenizer, text: str, seqlen: int, max_windows: int | None = None):
    """Token windows (W, seqlen) and the UTF-8 byte count each window's predictions cover. A tokenizer
    that adds BOS gets it first in each window and ``seqlen - 1`` tokens of text, all predicted."""
    from ..data.calibration import adds_bos

    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    lead = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
    span = seqlen - len(lead)
    count = len(ids) // span
    if max_windows is not None:
        count = min(count, max_windows)
    if count == 0:
        raise DataError(f"the corpus has {len(ids)} tokens, shorter than one window of {span}")
    windows, nbytes = [], []
    for w in range(count):
        start, end = w * span, (w + 1) * span
        windows.append(lead + ids[start:end])
        # The predicted tokens: start+1 .. end-1 (start .. end-1 after a BOS), the text from the first
        # one's start to the last one's end.
        a, b = offsets[start + (0 if lead else 1)][0], offsets[end - 1][1]
        nbytes.append(len(text[a:b].encode("utf-8")))
    return torch.tensor(windows, dtype=torch.long), nbytes


@torch.no_grad()
def token_nll(model, window: torch.Tensor, device="cpu") -> torch.Tensor:
    """Per-token NLL (nats) of window[1:] given the preceding tokens; window is (T,)."""
    logits = model(window[None].to(device), use_cache=False).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, window[1:].to(device), reduction="none").cpu()


def perplexity(model, tokenizer, text: str, seqlen: int = 2048, max_windows: int | None = None, device="cpu",
               progress=None) -> PerplexityResult:
    windows, nbytes = windows_of(tokenizer, text, seqlen, max_windows)
    nlls = []
    model.eval()
    for i, window in enumerate(windows):
        nlls.append(token_nll(model, window, device))
        if progress:
            progress("perplexity", i + 1, len(windows))
    all_nll = torch.cat(nlls).double()
    mean = float(all_nll.mean())
    stderr = float(all_nll.std(unbiased=True) / math.sqrt(all_nll.numel())) if all_nll.numel() > 1 else 0.0
    total_bytes = sum(nbytes)
    return PerplexityResult(
        perplexity=math.exp(mean),
        nll=mean,
        nll_stderr=stderr,
        perplexity_stderr=math.exp(mean) * stderr,
        bits_per_byte=float(all_nll.sum()) / math.log(2) / max(total_bytes, 1),
        tokens=int(all_nll.numel()),
        bytes=total_bytes,
        windows=len(windows),
        seqlen=seqlen,
    )


# --- any runtime ------------------------------------------------------------------------------


def rolling_windows(n_tokens: int, seqlen: int, stride: int | None = None, max_windows: int | None = None,
                    lead: int = 0):
    """(start, stop, first_scored) per window: windows of ``seqlen`` tokens every ``stride``
    tokens; each token is scored once, in the first window that predicts it with the most context
    (the Hugging Face strided-perplexity recipe; stride = seqlen gives non-overlapping windows).

    ``lead``: tokens put before each window's text (a BOS, for a tokenizer that adds one): a window
    then holds ``seqlen - lead`` text tokens, its first text token is scored too (predicted from the
    BOS alone), and a stride is at most the text a window holds."""
    span = seqlen - lead
    stride = span if stride is None else min(stride, span)
    if not 0 < stride <= span:
        raise DataError(f"stride must be in 1..{seqlen} (the window length), got {stride}")
    if n_tokens < span:
        raise DataError(f"the corpus has {n_tokens} tokens, shorter than one window of {span}")
    out, scored_to = [], (0 if lead else 1)  # without a lead, token 0 is never predicted
    start = 0
    while start + span <= n_tokens:
        stop = start + span
        first = max(scored_to, start + (0 if lead else 1))
        out.append((start, stop, first))
        scored_to = stop
        if max_windows is not None and len(out) >= max_windows:
            break
        start += stride
    return out


def lead_tokens(encoder) -> list[int]:
    """What each evaluation window starts with before its text: BOS for a tokenizer that adds one
    (Gemma's, Llama 3's), as ``llama-perplexity`` and lm-eval put it; nothing otherwise."""
    return [encoder.bos_id] if getattr(encoder, "adds_bos", False) and encoder.bos_id is not None else []


def log_softmax_np(x):
    import numpy as np

    from ..runtimes.base import _lse_numpy

    return np.asarray(x).astype(np.float64) - _lse_numpy(x)[:, None]


def runtime_perplexity(runtime, encoder, text: str, seqlen: int = 512, stride: int | None = None,
                       max_windows: int | None = None, progress=None, label: str = "perplexity"):
    """Perplexity, bits per byte and a standard error of ``text`` in any runtime.

    Returns (PerplexityResult, per-window list of (token ids, first scored index)).
    """
    import numpy as np

    from .tokens import covered_bytes

    ids, ends = _encode_enough(encoder, text, seqlen, stride, max_windows)
    lead = lead_tokens(encoder)
    wins = rolling_windows(len(ids), seqlen, stride, max_windows, lead=len(lead))
    nlls, total_bytes, kept = [], 0, []
    windows = [lead + ids[start:stop] for start, stop, _ in wins]
    # Each next token's log-probability (the runtime reduces the logits; a remote target sends back
    # one number per token, not a vocabulary-wide row). The windows go in together, so a runtime that
    # runs many in one pass (torch; streamed, it reads each block once per pass) can.
    scores = runtime.sequence_scores(windows)
    for i, ((start, stop, first), window, (lp, _)) in enumerate(zip(wins, windows, scores)):
        k = first - start + len(lead)  # first scored position within the window
        nlls.append(-np.asarray(lp[k - 1 :], dtype=np.float64))
        total_bytes += covered_bytes(ends, first, stop)
        kept.append((window, k))
        if progress:
            progress(label, i + 1, len(wins))
    all_nll = np.concatenate(nlls)
    mean = float(all_nll.mean())
    stderr = float(all_nll.std(ddof=1) / math.sqrt(all_nll.size)) if all_nll.size > 1 else 0.0
    result = PerplexityResult(perplexity=math.exp(mean), nll=mean, nll_stderr=stderr,
                              perplexity_stderr=math.exp(mean) * stderr,
                              bits_per_byte=float(all_nll.sum()) / math.log(2) / max(total_bytes, 1),
                              tokens=int(all_nll.size), bytes=total_bytes, windows=len(wins), seqlen=seqlen)
    return result, kept


def check_corpus_length(encoder, text: str, seqlen: int, name: str) -> None:
    """Refuse (DataError naming the corpus ``name``) a text shorter than one window of ``seqlen`` tokens
    in ``encoder``'s tokenizer (a lead BOS counted), before anything is measured."""
    lead = len(lead_tokens(encoder))
    ids, _ = _encode_enough(encoder, text, seqlen, None, 1, with_bytes=False)
    if len(ids) < seqlen - lead:
        raise DataError(f"the corpus {name} has {len(ids)} tokens in this model's tokenizer, shorter than one "
                        f"window of {seqlen - lead}: give a longer text, or --seqlen {len(ids) + lead} or less")


def _encode_enough(encoder, text: str, seqlen: int, stride: int | None, max_windows: int | None,
                   with_bytes: bool = True):
    """Token ids (and byte ends; ``with_bytes=False``: None) of as much of ``text`` as ``max_windows``
    windows need.

    Tokenizing all of WikiText-2 takes seconds; a prefix is enough for a few windows. The prefix
    grows until it yields a margin of tokens past what the windows use, so the tokens kept are
    the same as those of the whole text (only the last few near the cut can differ)."""
    encode = encoder.encode_with_bytes if with_bytes else (lambda t: (encoder.encode(t), None))
    if max_windows is None:
        return encode(text)
    need = seqlen + (max_windows - 1) * (stride or seqlen) + 64
    length = need * 8
    while True:
        ids, ends = encode(text[:length])
        if length >= len(text):
            return ids, ends
        if len(ids) > need:
            keep = need - 64 + 1
            return ids[:keep], (ends[:keep] if ends is not None else None)
        length *= 2
