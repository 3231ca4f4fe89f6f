"""Fidelity statistics and task flips on constructed cases whose answers are worked out by hand,
through the functions the product uses (logits -> log-softmax -> KL per position -> mean)."""

import math

import numpy as np
import pytest

from slmedge.errors import SlmedgeError
from slmedge.evaluate.fidelity import fidelity, task_flips
from slmedge.evaluate.tasks import ItemScore, summarize
from slmedge.runtimes import Runtime

LN2, LN3 = math.log(2), math.log(3)


class _Encoder:
    """'a' -> 1, 'b' -> 2, 'c' -> 0 (ord % 3): both sides tokenize alike, so the check passes."""

    def encode(self, text):
        return [ord(ch) % 3 for ch in text]


class _Runtime:
    """Fixed logits per position (the window's ids do not matter), optional final hidden states."""

    def __init__(self, name, logits, hidden=None):
        self.name, self._logits, self._hidden = name, np.asarray(logits, dtype=np.float64), hidden

    def logits(self, ids):
        assert len(ids) == len(self._logits)
        return self._logits

    def hidden_states(self, ids):
        return None if self._hidden is None else np.asarray(self._hidden, dtype=np.float64)

    sequence_outputs = Runtime.sequence_outputs  # the interface's own: logits and hidden states per window


# Three scored positions (a window of 4 tokens; the last row's logits predict nothing), V = 3.
# position 0: p = (1/2, 1/4, 1/4), q = (1/4, 1/2, 1/4)
#   KL(p||q) = 1/2 ln 2 + 1/4 ln(1/2) + 0 = 1/4 ln 2
# position 1: p = (1/4, 1/4, 1/2), q = (1/8, 3/8, 1/2)
#   KL(p||q) = 1/4 ln 2 + 1/4 ln(2/3) + 0 = 1/4 ln(4/3)  (the other direction, KL(q||p), is
#   1/8 ln(1/2) + 3/8 ln(3/2) = 0.0654..., not 0.0719...: the test tells the two apart)
# position 2: p = q = (1/2, 1/4, 1/4): KL 0
P = [[1 / 2, 1 / 4, 1 / 4], [1 / 4, 1 / 4, 1 / 2], [1 / 2, 1 / 4, 1 / 4], [1 / 3, 1 / 3, 1 / 3]]
Q = [[1 / 4, 1 / 2, 1 / 4], [1 / 8, 3 / 8, 1 / 2], [1 / 2, 1 / 4, 1 / 4], [1 / 3, 1 / 3, 1 / 3]]
TEXT = "aacc"  # ids 1, 1, 0, 0: the true next tokens of positions 0, 1, 2 are 1, 0, 0
KL0, KL1, KL2 = LN2 / 4, (2 * LN2 - LN3) / 4, 0.0
# The reference's log-probabilities are kept (and cached) in fp32: agreement to 1e-6 relative.
REL = 1e-6


def _runtimes(hidden=False):
    # Logits are log-probabilities plus an arbitrary offset per row (log-softmax removes it).
    ref = _Runtime("reference", np.log(P) + np.array([[3.0], [-1.0], [0.5], [0.0]]),
                   [[3.0, 4.0], [0.0, 0.0]] if hidden else None)
    cand = _Runtime("candidate", np.log(Q) + 7.0, [[3.0, 4.5], [0.0, 0.0]] if hidden else None)
    return cand, ref


def test_fidelity_statistics_equal_the_hand_computed_values():
    cand, ref = _runtimes()
    enc = _Encoder()
    stats = fidelity((cand, enc), (ref, enc), TEXT, seqlen=4, max_windows=1, reference_id="known-answer-kl")
    assert stats["tokens"] == 3 and stats["windows"] == 1 and stats["seqlen"] == 4
    # mean of (1/4 ln 2, 1/4 ln 4/3, 0) = (1/12) ln(8/3) = 0.08173...
    assert stats["kl_mean"] == pytest.approx(math.log(8 / 3) / 12, rel=REL)
    assert stats["kl_mean"] == pytest.approx(0.0817358, abs=1e-7)
    assert stats["kl_median"] == pytest.approx(KL1, rel=REL)  # 1/4 ln(4/3) = 0.07192...
    assert stats["kl_max"] == pytest.approx(KL0, rel=REL)  # 1/4 ln 2 = 0.17329...
    # numpy's linear percentile over the sorted (0, KL1, KL0): rank 0.99 * 2 = 1.98
    assert stats["kl_p99"] == pytest.approx(KL1 + 0.98 * (KL0 - KL1), rel=REL)
    mean = (KL0 + KL1 + KL2) / 3
    sd = math.sqrt(((KL0 - mean) ** 2 + (KL1 - mean) ** 2 + (KL2 - mean) ** 2) / 2)
    assert stats["kl_mean_stderr"] == pytest.approx(sd / math.sqrt(3), rel=REL)
    # argmax p vs argmax q: 0 vs 1 (differ), 2 vs 2, 0 vs 0: two of three agree
    assert stats["top1_agreement"] == pytest.approx(2 / 3, rel=REL)
    # Δp of the true token: position 0 (token 1) 1/2 - 1/4, position 1 (token 0) 1/8 - 1/4,
    # position 2 (token 0) 0: sqrt((1/16 + 1/64 + 0) / 3) = sqrt(5/192)
    assert stats["rms_delta_p"] == pytest.approx(math.sqrt(5 / 192), rel=REL)
    assert "hidden_snr_db" not in stats and stats["reference_cached"] is False
    again = fidelity((cand, enc), (ref, enc), TEXT, seqlen=4, max_windows=1, reference_id="known-answer-kl")
    assert again["reference_cached"] is True
    assert {k: v for k, v in again.items() if k != "reference_cached"} == \
        {k: v for k, v in stats.items() if k != "reference_cached"}


def test_hidden_state_snr_equals_the_hand_computed_value():
    cand, ref = _runtimes(hidden=True)
    enc = _Encoder()
    stats = fidelity((cand, enc), (ref, enc), TEXT, seqlen=4, max_windows=1, reference_id="known-answer-snr")
    # signal 3² + 4² = 25, noise 0.5² = 0.25: 10 log10(100) = 20 dB
    assert stats["hidden_snr_db"] == pytest.approx(20.0, rel=REL)
    assert stats["kl_mean"] == pytest.approx(math.log(8 / 3) / 12, rel=REL)


def test_a_model_against_itself_has_zero_kl_and_full_agreement():
    _, ref = _runtimes()
    enc = _Encoder()
    stats = fidelity((ref, enc), (ref, enc), TEXT, seqlen=4, max_windows=1, reference_id="known-answer-self")
    assert stats["kl_mean"] == pytest.approx(0.0, abs=1e-7) and stats["kl_max"] == pytest.approx(0.0, abs=1e-7)
    assert stats["top1_agreement"] == 1.0 and stats["rms_delta_p"] == pytest.approx(0.0, abs=1e-7)


# Five items, gold answers 0 1 2 0 1:
#   item 0: reference right (0), model wrong (1)   -> flip, right to wrong
#   item 1: reference wrong (0), model right (1)   -> flip, wrong to right
#   item 2: both wrong, different answers (0, 1)  -> flip with no change in accuracy
#   item 3: both right (0)                         -> no flip
#   item 4: both wrong, same answer (2)            -> no flip
# acc: the reference 2/5 (items 0, 3), the model 2/5 (items 1, 3): equal, yet 3 of 5 answers moved.
# acc_norm answers (pred_norm) move on item 4 only (2 -> 0): 1 of 5.
GOLD = [0, 1, 2, 0, 1]
REF_PRED, CAND_PRED = [0, 0, 0, 0, 2], [1, 1, 1, 0, 2]
REF_NORM, CAND_NORM = [0, 0, 0, 0, 2], [0, 0, 0, 0, 0]


def _items(preds, norms):
    return [ItemScore([0.0, -1.0, -2.0], p, n, g) for p, n, g in zip(preds, norms, GOLD)]


def test_task_flips_count_both_directions_on_a_constructed_case():
    ref, cand = _items(REF_PRED, REF_NORM), _items(CAND_PRED, CAND_NORM)
    assert task_flips(cand, ref) == pytest.approx(3 / 5)
    assert task_flips(ref, cand) == pytest.approx(3 / 5)  # a flip is a flip whichever side is the reference
    assert task_flips(cand, ref, norm=True) == pytest.approx(1 / 5)
    assert task_flips(ref, ref) == 0.0 and task_flips(ref, ref, norm=True) == 0.0
    acc_ref, acc_cand = summarize(ref, has_norm=True), summarize(cand, has_norm=True)
    assert acc_ref["acc"] == acc_cand["acc"] == pytest.approx(2 / 5)
    # stderr of (1, 0, 0, 1, 0): sample sd sqrt(0.3), over sqrt(5): sqrt(0.06)
    assert acc_ref["acc_stderr"] == pytest.approx(math.sqrt(0.06), rel=1e-12)
    assert acc_ref["acc_norm"] == pytest.approx(2 / 5) and acc_cand["acc_norm"] == pytest.approx(2 / 5)


def test_task_flips_refuse_different_item_lists():
    ref, cand = _items(REF_PRED, REF_NORM), _items(CAND_PRED, CAND_NORM)
    with pytest.raises(SlmedgeError, match="same items"):
        task_flips(cand[:4], ref)
    other = [ItemScore(s.loglikelihoods, s.pred, s.pred_norm, (s.gold + 1) % 3) for s in ref]
    with pytest.raises(SlmedgeError, match="same items"):
        task_flips(cand, other)
