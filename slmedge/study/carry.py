"""Not repeating on a second target what is proven identical.

A study's ``[evaluate.<target>] same_as = "<other>"`` says: the exactness numbers of a file on
this target (perplexity, fidelity, tasks: what the file computes) are the other target's, once a
probe shows the two compute the same. The probe scores the file's first ``probe_tokens`` tokens of
WikiText-2 on both targets, in the same runtime, and compares every token's log-probability. Within
``probe_tolerance`` nats everywhere, this target's rows are the other's (each marked
``carried_from``), beside the probe's own rows; past it, the target measures everything itself, as
without ``same_as``. Under qemu a 135M-parameter file runs ~60x slower than here, so a probe of 128
tokens replaces a few thousand emulated tokens of perplexity windows and task items.

Memory and speed are the device's own and are never carried (the study refuses them with same_as).
"""

from __future__ import annotations

import math

import numpy as np

# The rows each carried metric writes (Evaluation._perplexity, _fidelity, _tasks); a test checks that
# an evaluation writes no other row for them.
METRIC_ROWS = {
    "perplexity": ("perplexity", "bits_per_byte"),
    "fidelity": ("kl_mean", "kl_median", "kl_p99", "top1_agreement", "rms_delta_p", "hidden_snr_db"),
    "tasks": ("acc", "acc_norm", "task_flips", "task_flips_norm"),
}


def probe_ids(encoder, tokens: int, data_dir=None) -> list[int]:
    """The first ``tokens`` + 1 token ids of WikiText-2 (the first one is context, never scored)."""
    from ..errors import DataError
    from ..evaluate.corpora import load_corpus
    from ..evaluate.perplexity import _encode_enough

    # as a perplexity window of ``tokens`` + 1 tokens is tokenized: from a prefix of the corpus
    ids, _ = _encode_enough(encoder, load_corpus("wikitext2", data_dir), tokens, None, 1, with_bytes=False)
    if len(ids) < tokens + 1:
        raise DataError(f"WikiText-2 gave {len(ids)} tokens, fewer than the {tokens}-token probe")
    return ids[: tokens + 1]


def token_logprobs(runtime, ids: list[int]) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i >= 1, as the runtime scores a perplexity window."""
    lp, _ = next(iter(runtime.sequence_scores([ids])))
    return np.asarray(lp, dtype=np.float64)


def compare(here: np.ndarray, there: np.ndarray, tolerance: float) -> dict:
    """The probe's verdict: the largest and mean |difference| of the per-token log-probabilities."""
    if here.shape != there.shape:
        return {"tokens": int(min(here.size, there.size)), "max_abs_dlogp": math.inf, "mean_abs_dlogp": math.inf,
                "tolerance": tolerance, "same": False, "why": f"scored {here.size} and {there.size} tokens"}
    d = np.abs(here - there)
    finite = bool(np.isfinite(d).all())
    worst = float(d.max()) if finite else math.inf
    return {"tokens": int(d.size), "max_abs_dlogp": worst, "mean_abs_dlogp": float(d.mean()) if finite else math.inf,
            "tolerance": tolerance, "same": finite and worst <= tolerance}


def reference_logprobs(path: str, target: str, runtime: str, threads, ids: list[int], n_ctx: int) -> np.ndarray:
    """The probe on the target whose numbers are carried: the same file, in the same runtime."""
    from ..evaluate.subject import open_on_target
    from ..targets.profiles import get_profile

    sub = open_on_target(path, runtime, threads, n_ctx, get_profile(target))
    try:
        return token_logprobs(sub.runtime, ids)
    finally:
        sub.close()


def carried_rows(rows: list[dict], metrics) -> list[dict]:
    """The rows of ``metrics`` among another evaluation's rows (each: metric, subset, value, stderr, unit, extra)."""
    wanted = {name for m in metrics for name in METRIC_ROWS.get(m, ())}
    return [r for r in rows if r["metric"] in wanted]


def run_rows(store, run_id: int) -> dict:
    """A finished evaluation's settings and rows (metric, subset, value, stderr, unit, extra), as the store holds them."""
    keys = ("metric", "subset", "value", "stderr", "unit", "extra")
    return {"settings": store.run_settings(run_id), "rows": [{k: r[k] for k in keys} for r in store.rows(run_id)]}
