"""Make transformers' tokenizer of a GGUF file split text the way llama.cpp does.

transformers builds the tokenizer of Gemma 2/3 GGUF files (``tokenizer.ggml.model = "llama"``:
SentencePiece BPE) as a *Unigram* model over the pieces' scores. SentencePiece BPE does not
choose the segmentation with the best total score; it merges the adjacent pair whose result has
the highest score, again and again (llama.cpp's ``llm_tokenizer_spm``). The Unigram reading
splits ordinary words into many short pieces: on Gemma 3 270M it gave 8,807 tokens for the
first 20,000 characters of NTREX English where llama.cpp gives 4,440, and the model, fed pieces
it never saw in training, scored perplexity ~101 instead of ~23 on WikiText-2.

:func:`repair_gguf_tokenizer` rebuilds such a tokenizer as the BPE it is: every piece's
two-piece splits become merges ranked by the piece's score (so the highest-scoring mergeable
pair goes first, leftmost on ties, as in llama.cpp), bytes fall back to ``<0xNN>`` pieces, and
the file's user-defined pieces (Gemma's runs of spaces, tabs and newlines) are matched whole
before the merges, as llama.cpp matches them. The import check then compares the result with
llama.cpp's own tokenizer on :data:`TOKENIZER_PROBE` before anything is built on it.
"""

from __future__ import annotations

import json
from pathlib import Path

# llama.cpp's token types (gguf.TokenType)
USER_DEFINED = 4

# Text that exercises what tokenizers get wrong: runs of spaces, tabs and newlines, digits,
# punctuation, scripts without spaces, combining marks, characters outside the vocabulary.
TOKENIZER_PROBE = (
    "The quick brown fox  jumps over the   lazy dog.\n\nIn 1969, astronauts first walked on the Moon;\t"
    "the photographs\t\tare still studied today.\n\n\n    def add(a, b):\n        return a + b\n"
    "Die Katze schläft auf dem Sofa, während es draußen regnet. ¿Dónde está la estación?\n"
    "猫在沙发上睡觉，外面正在下雨。 แมวนอนอยู่บนโซฟาขณะที่ฝนตกข้างนอก "
    "बिल्ली सोफे पर सो रही है। القطة نائمة على الأريكة بينما تمطر في الخارج. "
    "Кошка спит на диване. 12345678 + 0.5 = ? 🙂 ﬁ x²\r\n  end"
)


def _gguf_vocabulary(gguf_path: Path) -> tuple[str | None, list[str], list[int]]:
    """(tokenizer.ggml.model, tokens, token types) of a GGUF file; (None, [], []) when unreadable."""
    try:
        from gguf import GGUFReader

        fields = GGUFReader(str(gguf_path)).fields
        model, tokens, types = (fields.get(f"tokenizer.ggml.{k}") for k in ("model", "tokens", "token_type"))
        name = bytes(model.parts[model.data[0]]).decode("utf-8")
        pieces = [bytes(tokens.parts[i]).decode("utf-8") for i in tokens.data]
        kinds = [int(types.parts[i][0]) for i in types.data] if types is not None else [1] * len(pieces)
    except Exception:  # noqa: BLE001 - not a GGUF vocabulary we can read: leave the tokenizer alone
        return None, [], []
    return name, pieces, kinds


def spm_bpe_state(state: dict, tokens: list[str], token_types: list[int]) -> dict:
    """A tokenizers state (``Tokenizer.to_str()`` JSON) whose Unigram model is replaced by the
    SentencePiece-BPE model over the GGUF file's ``tokens`` (scores from the Unigram model, which
    holds them in the same order), with user-defined pieces matched whole.

    Pieces are the file's own, with spaces written "▁" as the normalizer writes them (the
    user-defined runs of spaces are stored with plain spaces); transformers' converter also renames
    ``<0x09>`` to a tab, which collides with Gemma's own tab piece, so its names are not used."""
    scores = [score for _piece, score in state["model"]["vocab"]]
    vocab = [(token.replace(" ", "▁"), score) for token, score in zip(tokens, scores)]
    ids: dict[str, int] = {}
    for i, (piece, _score) in enumerate(vocab):
        ids.setdefault(piece, i)
    ranked = []
    for i, (piece, score) in enumerate(vocab):
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in ids and right in ids:
                ranked.append((-score, i, k, left, right))
    ranked.sort()
    unk_id = state["model"].get("unk_id")
    new = dict(state)
    new["model"] = {
        "type": "BPE",
        "dropout": None,
        "unk_token": vocab[unk_id][0] if unk_id is not None else None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": True,
        "byte_fallback": True,
        "ignore_merges": False,
        "vocab": ids,
        "merges": [[left, right] for *_, left, right in ranked],
    }
    added = list(state.get("added_tokens") or [])
    have = {t["id"] for t in added}
    for i, kind in enumerate(token_types):
        if kind == USER_DEFINED and i not in have and i < len(vocab):
            # Matched on the normalized text (spaces already turned into "▁"), as the vocab is.
            added.append({"id": i, "content": vocab[i][0], "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": True, "special": False})
    new["added_tokens"] = added
    return new


def repair_gguf_tokenizer(tokenizer, gguf_path: Path) -> str | None:
    """Rebuild ``tokenizer`` in place when transformers read a SentencePiece-BPE GGUF vocabulary
    as Unigram; returns what was done (for the import record) or None when nothing was needed."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    state = json.loads(backend.to_str())
    if state.get("model", {}).get("type") != "Unigram":
        return None
    name, tokens, types = _gguf_vocabulary(Path(gguf_path))
    if name != "llama" or len(tokens) != len(state["model"]["vocab"]):
        return None
    from tokenizers import Tokenizer

    tokenizer._tokenizer = Tokenizer.from_str(json.dumps(spm_bpe_state(state, tokens, types)))
    users = sum(1 for t in types if t == USER_DEFINED)
    return f"SentencePiece-BPE rebuilt from the Unigram reading ({users} user-defined pieces matched whole)"
