"""Fidelity of a model to a reference: the statistics ``llama-perplexity --kl-divergence`` prints.

On the same token windows: KL(reference || candidate) per position (mean, median, 99th
percentile), top-1 agreement, RMS of Δp of the true token, and the SNR in dB of the final hidden
states where both runtimes expose them (torch). Reference log-probabilities are computed once
and cached (fp32, keyed by the reference's identity and the token ids), so comparing many
artifacts against one base does not recompute it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np

from ..errors import SlmedgeError
from ..paths import cache_dir
from .perplexity import _encode_enough, lead_tokens, log_softmax_np, rolling_windows

PROBE = "The quick brown fox jumps over the lazy dog. Zürich, 2024: naïve café — 東京 and भारत."


class TokenizerMismatchError(SlmedgeError):
    """The reference tokenizes text differently, so position-wise comparisons are meaningless."""


def check_same_tokenizer(candidate_encoder, reference_encoder, text: str) -> None:
    sample = PROBE + " " + text[:2000]
    a, b = candidate_encoder.encode(sample), reference_encoder.encode(sample)
    if a != b:
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise TokenizerMismatchError(
            f"the reference tokenizes text differently from the model (first difference at token {first}); "
            "fidelity needs the same tokenizer: choose a --reference of the same model family")


def _cache_path(reference_id: str, windows: list[list[int]]) -> os.PathLike:
    h = hashlib.sha256(reference_id.encode())
    for w in windows:  # each window's length first: two windows of 16 tokens are not one of the same 32
        h.update(len(w).to_bytes(8, "little"))
        h.update(np.asarray(w, dtype=np.int64).tobytes())
    root = cache_dir() / "reference"
    root.mkdir(parents=True, exist_ok=True)
    return root / f"{h.hexdigest()[:24]}.npz"


def _arrays_digest(arrays: dict) -> str:
    """sha256 over named arrays (name, dtype, shape and bytes, in name order)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def reference_outputs(runtime, windows: list[list[int]], reference_id: str, with_hidden: bool, progress=None):
    """Per window (log-probs fp32 (T-1, V), final hidden states or None); cached on disk."""
    path = _cache_path(reference_id + ("|hidden" if with_hidden else ""), windows)
    if path.is_file():
        try:
            with np.load(path) as data:
                arrays = {k: data[k] for k in data.files}
            recorded = arrays.pop("sha256", None)
            # A cache entry is used only as written: its arrays match the digest stored with them.
            if recorded is None or recorded.tobytes().hex() != _arrays_digest(arrays):
                raise ValueError("changed since written")
            lps = [arrays[f"lp{i}"] for i in range(len(windows))]
            hid = [arrays.get(f"h{i}") for i in range(len(windows))]
            return lps, hid, True
        except (OSError, ValueError, KeyError):
            path.unlink(missing_ok=True)
    lps, hid = [], []
    # One pass gives a window's logits and hidden states; windows go in together (see sequence_outputs).
    for i, (logits, h) in enumerate(runtime.sequence_outputs(windows, with_hidden)):
        lps.append(log_softmax_np(logits)[:-1].astype(np.float32))
        hid.append(h)
        if progress:
            progress("reference", i + 1, len(windows))
    arrays = {f"lp{i}": lp for i, lp in enumerate(lps)}
    arrays.update({f"h{i}": h.astype(np.float32) for i, h in enumerate(hid) if h is not None})
    arrays["sha256"] = np.frombuffer(bytes.fromhex(_arrays_digest(arrays)), dtype=np.uint8)
    tmp = path.with_name(f".{path.stem}-{os.getpid()}.npz")
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    except OSError:  # a cache that cannot be written only costs time later
        tmp.unlink(missing_ok=True)
    return lps, hid, False


def fidelity(candidate, reference, text: str, seqlen: int = 512, max_windows: int = 2, reference_id: str = "",
             progress=None) -> dict:
    """``candidate``/``reference``: (runtime, encoder) pairs. Windows of ``text`` tokens."""
    cand_rt, cand_enc = candidate
    ref_rt, ref_enc = reference
    check_same_tokenizer(cand_enc, ref_enc, text)
    ids, _ = _encode_enough(cand_enc, text, seqlen, None, max_windows, with_bytes=False)  # the windows' tokens, not the whole corpus's
    lead = lead_tokens(cand_enc)  # BOS first where the tokenizer adds it, as in use
    windows = [lead + ids[a:b] for a, b, _ in rolling_windows(len(ids), seqlen, None, max_windows, lead=len(lead))]
    with_hidden = cand_rt.hidden_states([1, 2]) is not None and ref_rt.hidden_states([1, 2]) is not None
    ref_lps, ref_hid, cached = reference_outputs(ref_rt, windows, reference_id or ref_rt.name, with_hidden, progress)
    kls, top1, dp2 = [], [], []
    sig = noise = 0.0
    for i, (w, (logits, h)) in enumerate(zip(windows, cand_rt.sequence_outputs(windows, with_hidden))):
        lq = log_softmax_np(logits)[:-1]
        lp32 = ref_lps[i]
        if lp32.shape[1] != lq.shape[1]:
            n = min(lp32.shape[1], lq.shape[1])  # padded vocabularies: compare the shared part
            lp32, lq = lp32[:, :n], lq[:, :n]
        lp = lp32.astype(np.float64)
        p = np.exp(lp32).astype(np.float64)  # (float32 exponentials: ~1e-7 relative, 50x faster than float64's)
        kls.append((p * (lp - lq)).sum(-1))
        top1.append(lp.argmax(-1) == lq.argmax(-1))
        t = np.asarray(w[1:])
        rows = np.arange(len(t))
        dp2.append((np.exp(lq[rows, t]) - p[rows, t]) ** 2)
        if with_hidden:
            sig += float((ref_hid[i].astype(np.float64) ** 2).sum())
            noise += float(((ref_hid[i].astype(np.float64) - h) ** 2).sum())
        if progress:
            progress("fidelity", i + 1, len(windows))
    kl = np.maximum(np.concatenate(kls), 0.0)
    agree = np.concatenate(top1)
    out = {
        "kl_mean": float(kl.mean()), "kl_mean_stderr": float(kl.std(ddof=1) / math.sqrt(kl.size)) if kl.size > 1 else 0.0,
        "kl_median": float(np.median(kl)), "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
        "top1_agreement": float(agree.mean()), "rms_delta_p": float(math.sqrt(np.concatenate(dp2).mean())),
        "tokens": int(kl.size), "windows": len(windows), "seqlen": seqlen, "reference_cached": cached,
    }
    if with_hidden:
        out["hidden_snr_db"] = float(10 * math.log10(sig / noise)) if noise > 0 else float("inf")
    return out


def task_flips(candidate_scores, reference_scores, norm: bool = False) -> float:
    """Share of task items whose predicted answer differs between the model and the reference:
    the answers ``acc`` counts, or with ``norm`` those ``acc_norm`` counts."""
    if len(candidate_scores) != len(reference_scores) or any(
            a.gold != b.gold for a, b in zip(candidate_scores, reference_scores)):
        raise SlmedgeError(f"task flips need the same items: the model scored {len(candidate_scores)}, "
                           f"the reference {len(reference_scores)} (or their gold answers differ)")
    if not candidate_scores:
        return 0.0
    attr = "pred_norm" if norm else "pred"
    flips = sum(getattr(a, attr) != getattr(b, attr) for a, b in zip(candidate_scores, reference_scores))
    return flips / len(candidate_scores)


def identity_key(identity: dict, runtime: str) -> str:
    """What the reference's cached outputs are keyed by: the model, its runtime, and the libraries that
    compute them (another transformers or llama.cpp release may give other logits)."""
    from ..compress.artifact import library_versions

    return json.dumps({"sha256": identity.get("sha256"), "path": identity.get("path"), "name": identity.get("name"),
                       "runtime": runtime, "libraries": library_versions()}, sort_keys=True)
