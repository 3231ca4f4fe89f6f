"""The SentencePiece-BPE rebuild of a GGUF vocabulary that transformers read as Unigram."""

import json

from tokenizers import Tokenizer, normalizers
from tokenizers.models import Unigram

from slmedge.models.gguf_tokenizer import USER_DEFINED, spm_bpe_state

# id: piece, score. SentencePiece BPE merges the adjacent pair whose result scores highest:
# "abcd" -> a b c d -> (ab) c d -> (ab) (cd). Unigram maximizes the summed score: a + bcd = -2.5
# beats ab + cd = -5, so it says [a, bcd]: the kind of split transformers gave Gemma 3.
PIECES = [("<unk>", 0.0), ("a", -2.0), ("b", -2.0), ("c", -2.0), ("d", -2.0), ("ab", -1.0), ("cd", -4.0),
          ("bcd", -0.5), ("bc", -3.0), ("▁", -2.0), ("▁b", -0.1), ("  ", -9.0), ("<0x41>", 0.0)]
USER = {11}  # the run of two spaces is a user-defined piece, matched whole (as llama.cpp does)


def unigram_state():
    tok = Tokenizer(Unigram([(p.replace(" ", "▁"), s) for p, s in PIECES], unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    return json.loads(tok.to_str())


def rebuilt():
    types = [USER_DEFINED if i in USER else 1 for i in range(len(PIECES))]
    return Tokenizer.from_str(json.dumps(spm_bpe_state(unigram_state(), [p for p, _ in PIECES], types)))


def test_unigram_reading_splits_differently_from_spm_bpe():
    unigram = Tokenizer.from_str(json.dumps(unigram_state()))
    assert unigram.encode("abcd").tokens == ["a", "bcd"]
    assert rebuilt().encode("abcd").tokens == ["ab", "cd"]


def test_highest_scoring_pair_first_then_leftmost():
    tok = rebuilt()
    assert tok.encode("bcd").tokens == ["bcd"]  # b c d -> (bc) d -> (bcd): bc is the only mergeable pair first
    assert tok.encode("abab").tokens == ["ab", "ab"]
    assert tok.encode("b").ids == [2]


def test_user_defined_pieces_are_matched_before_merges():
    tok = rebuilt()
    # "a  b" -> "a▁▁b": the user-defined "▁▁" wins over the higher-scoring merge "▁b".
    assert tok.encode("a  b").ids == [1, 11, 2]
    assert tok.encode("a b").tokens == ["a", "▁b"]


def test_characters_outside_the_vocabulary_fall_back_to_bytes():
    assert rebuilt().encode("aA").ids == [1, 12]  # "A" is byte 0x41
