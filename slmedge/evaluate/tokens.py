"""Text -> token ids, one tokenizer per evaluated model, with the UTF-8 bytes each token covers.

Bits per byte needs the UTF-8 bytes of text a run of predicted tokens covers: the sum of the
byte lengths of their pieces (exact for byte-level BPE, where one character can be split across
tokens; for SentencePiece a piece's "▁" is one space byte and a <0xNN> fallback one byte).
With llama.cpp's own tokenizer (a bare .gguf file) they are the lengths of the pieces it returns.
"""

from __future__ import annotations

import numpy as np

from ..data.calibration import adds_bos


class Encoder:
    kind = ""
    bos_id: int | None = None
    eos_id: int | None = None
    # Whether the tokenizer puts BOS in front of a text by default (lm-eval's hf model then
    # scores tasks with it, so task scoring does too).
    adds_bos: bool = False

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_with_bytes(self, text: str) -> tuple[list[int], np.ndarray]:
        """ids and the cumulative UTF-8 byte position at the end of each token (int64)."""
        raise NotImplementedError

    def fingerprint(self, probe: str) -> list[int]:
        return self.encode(probe)


class HFEncoder(Encoder):
    kind = "transformers"

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.bos_id = tokenizer.bos_token_id
        self.eos_id = tokenizer.eos_token_id
        self.adds_bos = adds_bos(tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False, verbose=False)["input_ids"])

    def encode_with_bytes(self, text: str):
        ids = self.encode(text)
        lengths = self._byte_lengths()
        arr = np.asarray(ids, dtype=np.int64)
        return ids, np.cumsum(lengths[arr]) if len(ids) else np.zeros(0, dtype=np.int64)

    def _byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes each token id stands for: byte-level BPE through GPT-2's byte alphabet;
        SentencePiece pieces with "▁" as a space and <0xNN> byte fallbacks as one byte."""
        if getattr(self, "_lengths", None) is not None:
            return self._lengths
        vocab = self.tok.get_vocab()
        size = max(max(vocab.values()) + 1, len(self.tok))
        lengths = np.zeros(size, dtype=np.int64)
        special = set(getattr(self.tok, "all_special_tokens", []))
        added = set(self.tok.get_added_vocab()) if hasattr(self.tok, "get_added_vocab") else set()
        byte_level = _is_byte_level(self.tok)
        if byte_level:
            byte_of = {u: b for b, u in _bytes_to_unicode().items()}
        for piece, idx in vocab.items():
            if piece in special or piece in added:
                n = 0 if piece in special else len(piece.encode("utf-8"))
            elif byte_level:
                n = sum(1 if ch in byte_of else len(ch.encode("utf-8")) for ch in piece)
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                n = 1
            else:
                n = len(piece.replace("\u2581", " ").encode("utf-8"))
            lengths[idx] = n
        self._lengths = lengths
        return lengths


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character byte-level BPE vocabularies
    spell it (printable Latin-1 bytes as themselves, the rest shifted past U+0100). transformers 5
    no longer exports its copy from the GPT-2 tokenizer module."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    shift = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + shift)
            shift += 1
    return dict(zip(keep, map(chr, chars)))


class LlamaCppEncoder(Encoder):
    kind = "llama.cpp"

    def __init__(self, llm):
        self.llm = llm
        self.bos_id = llm.token_bos() if llm.token_bos() >= 0 else None
        self.eos_id = llm.token_eos() if llm.token_eos() >= 0 else None
        self.adds_bos = self.bos_id is not None and bool(llm._model.add_bos_token())

    def encode(self, text: str) -> list[int]:
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    def encode_with_bytes(self, text: str):
        ids = self.encode(text)
        lengths = self._byte_lengths()
        return ids, np.cumsum(lengths[np.asarray(ids, dtype=np.int64)]) if ids else np.zeros(0, dtype=np.int64)

    def _byte_lengths(self) -> np.ndarray:
        """Bytes of each token's piece as llama.cpp renders it (no leading-space stripping, control
        tokens empty)."""
        if getattr(self, "_lengths", None) is not None:
            return self._lengths
        import ctypes

        import llama_cpp

        vocab = self.llm._model.vocab
        n_vocab = self.llm.n_vocab()
        buf = ctypes.create_string_buffer(256)
        lengths = np.zeros(n_vocab, dtype=np.int64)
        for t in range(n_vocab):
            n = llama_cpp.llama_token_to_piece(vocab, t, buf, len(buf), 0, False)
            lengths[t] = max(n, 0) if n >= 0 else -n
        self._lengths = lengths
        return lengths


def _is_byte_level(tok) -> bool:
    """Whether tokenizer.json's decoder (or pre-tokenizer) is byte-level, also inside a Sequence."""
    import json

    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return False
    spec = json.loads(backend.to_str())
    parts = json.dumps([spec.get("decoder"), spec.get("pre_tokenizer")])
    return '"ByteLevel"' in parts


def covered_bytes(ends: np.ndarray, start: int, stop: int) -> int:
    """UTF-8 bytes covered by tokens start..stop-1 (start >= 1: from the end of token start-1)."""
    before = int(ends[start - 1]) if start > 0 else 0
    return int(ends[stop - 1]) - before
