"""The GGUF vocabulary: a tokenizer written as llama.cpp's tokenizer metadata.

Byte-level BPE (tokenizer.json) becomes llama.cpp's "gpt2" model with the pre-tokenizer name
llama.cpp knows for its split; SentencePiece vocabularies (tokenizer.model, or a byte-fallback
tokenizer.json) its "llama" model; a model imported from a GGUF file that is still there
unchanged gets that file's tokenizer metadata copied as it is. Special tokens, add_bos/add_eos
as transformers applies them, and the chat template come along. Verification then checks that
llama.cpp tokenizes the probe as transformers does.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from ..fsutil import sha256_file
from ..models.source import tokenizer_kwargs
from .errors import GGUFExportError
from .source import ExportSource

# Byte-level BPE pre-tokenizers, recognised by the structure of tokenizer.json's pre_tokenizer,
# to llama.cpp's tokenizer.ggml.pre names. llama.cpp refuses names it does not know; an
# unrecognised structure is written as "default" (and verification then checks that llama.cpp
# tokenizes like transformers).
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[tuple, str] = {
    (("ByteLevel", True),): "gpt-2",
    (("Digits", True), ("ByteLevel", True)): "smollm",
    (("Split", _QWEN2_REGEX), ("ByteLevel", False)): "qwen2",
    (("Split", _LLAMA3_REGEX), ("ByteLevel", False)): "llama-bpe",
}



def _pre_parts(pt) -> list[tuple]:
    if not pt:
        return []
    kind = pt.get("type")
    if kind == "Sequence":
        return [part for sub in pt.get("pretokenizers", []) for part in _pre_parts(sub)]
    if kind == "ByteLevel":
        if pt.get("add_prefix_space"):
            return [("ByteLevel+prefix", bool(pt.get("use_regex", True)))]
        return [("ByteLevel", bool(pt.get("use_regex", True)))]
    if kind == "Split":
        pattern = pt.get("pattern", {})
        return [("Split", pattern.get("Regex", pattern.get("String")))]
    if kind == "Digits":
        return [("Digits", bool(pt.get("individual_digits")))]
    return [(kind,)]


def pre_tokenizer_name(tokenizer_json: dict) -> tuple[str, bool]:
    """llama.cpp's pre-tokenizer name for a byte-level BPE tokenizer.json; (name, recognised)."""
    name = PRE_TOKENIZERS.get(tuple(_pre_parts(tokenizer_json.get("pre_tokenizer"))))
    return (name, True) if name else ("default", False)


def _base_gguf(src: ExportSource) -> Path | None:
    """The GGUF file the model was imported from, when it is still there unchanged."""
    base = (src.artifact.manifest.get("base_model") or {}) if src.artifact else {}
    if not base:
        record = src.path / "slmedge-source.json"  # a cached GGUF import
        if record.is_file():
            base = json.loads(record.read_text(encoding="utf-8"))
    digest = base.get("gguf_sha256")
    if not digest:
        return None
    candidates = []
    if base.get("kind") == "gguf" and base.get("path"):
        from ..paths import resolve_recorded

        found = resolve_recorded(base["path"], src.path)  # relative to the artifact (earlier versions: absolute)
        if found is not None:
            candidates.append(found)
    from ..models.source import EMBEDDED, embedded_gguf_path

    names = [base["name"]] if base.get("kind") == "embedded" and base.get("name") in EMBEDDED else \
        [n for n, e in EMBEDDED.items() if e.filename == base.get("gguf_file")]  # a cached import
    for name in names:
        try:
            candidates.append(embedded_gguf_path(name))
        except Exception:  # noqa: BLE001 - the package may be gone; fall back to tokenizer.json
            pass
    for path in candidates:
        if path.is_file() and sha256_file(path) == digest:
            return path
    return None


def _copy_tokenizer_from_gguf(writer, path: Path, vocab_size: int) -> dict | None:
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = {name: f for name, f in reader.fields.items() if name.startswith("tokenizer.")}
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens.data) != vocab_size:
        return None
    for name, f in fields.items():
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, f.contents(), gguf.GGUFValueType.ARRAY, sub_type=f.types[-1])
        else:
            writer.add_key_value(name, f.contents(), f.types[0])
    model = fields["tokenizer.ggml.model"].contents()
    pre = fields["tokenizer.ggml.pre"].contents() if "tokenizer.ggml.pre" in fields else None
    return {"source": f"gguf:{path.name}", "model": model, "pre": pre, "pre_recognised": True}


def _add_special_flags(writer, tok, special_vocab) -> dict:
    """add_bos/add_eos as transformers actually applies them (when the files do not say)."""
    ids = tok("a", add_special_tokens=True)["input_ids"]
    plain = tok("a", add_special_tokens=False)["input_ids"]
    flags = {}
    if "bos" not in special_vocab.add_special_token:
        flags["bos"] = tok.bos_token_id is not None and len(ids) > len(plain) and ids[0] == tok.bos_token_id
        writer.add_add_bos_token(flags["bos"])
    if "eos" not in special_vocab.add_special_token:
        flags["eos"] = tok.eos_token_id is not None and len(ids) > len(plain) and ids[-1] == tok.eos_token_id
        writer.add_add_eos_token(flags["eos"])
    return flags


def add_tokenizer(writer, src: ExportSource) -> dict:
    import gguf
    from transformers import AutoTokenizer

    vocab_size = int(src.config.vocab_size)
    base = _base_gguf(src)
    if base is not None:
        info = _copy_tokenizer_from_gguf(writer, base, vocab_size)
        if info:
            return info
    tj_path = src.path / "tokenizer.json"
    if not tj_path.is_file():
        if (src.path / "tokenizer.model").is_file():
            return _add_sentencepiece(writer, src, vocab_size)
        raise GGUFExportError(f"{src.path} has no tokenizer.json or tokenizer.model to write the vocabulary from")
    tj = json.loads(tj_path.read_text(encoding="utf-8"))
    model = tj.get("model", {})
    # byte_fallback matters only without a ByteLevel pre-tokenizer: with one every byte already has its
    # token (GPT-2 style; transformers' conversion of a GGUF "gpt2" vocabulary sets both).
    byte_level = any(part[0].startswith("ByteLevel") for part in _pre_parts(tj.get("pre_tokenizer")))
    if model.get("type") != "BPE" or (model.get("byte_fallback") and not byte_level):
        return _add_sentencepiece(writer, src, vocab_size)
    tok = AutoTokenizer.from_pretrained(str(src.path), **tokenizer_kwargs(src.path))
    pre, recognised = pre_tokenizer_name(tj)
    if not recognised:
        warnings.warn(f"the pre-tokenizer of {tj_path} is not one slmedge knows; written as llama.cpp's 'default' "
                      "(verification checks llama.cpp tokenizes the same)", stacklevel=3)
    # convert_hf_to_gguf.py's get_vocab_base
    vocab = tok.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise GGUFExportError(f"the tokenizer has ids beyond the model's vocabulary ({vocab_size})")
    reverse = {i: t for t, i in vocab.items()}
    added = tok.get_added_vocab()
    decoder = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            entry = decoder.get(i)
            if entry is not None and not entry.normalized:
                token = tok.decode(tok.encode(token, add_special_tokens=False))
            if (entry is not None and entry.special) or (token.startswith("<|") and token.endswith("|>")):
                types.append(gguf.TokenType.CONTROL)
            else:
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(str(src.path), load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
    flags = _add_special_flags(writer, tok, special)
    return {"source": "tokenizer.json", "model": "gpt2", "pre": pre, "pre_recognised": recognised,
            "merges": len(special.merges), "special_ids": dict(special.special_token_ids),
            "add_special": {**special.add_special_token, **flags}, "chat_template": special.chat_template is not None}


def _add_sentencepiece(writer, src: ExportSource, vocab_size: int) -> dict:
    """SentencePiece-style vocabularies (Llama 2, Mistral): llama.cpp's "llama" tokenizer model."""
    import gguf

    # The SentencePiece model itself carries the piece scores llama.cpp's tokenizer merges by;
    # gguf's tokenizer.json reader (LlamaHfVocab) writes placeholder scores, so there the
    # scores are derived from the ids (SentencePiece BPE orders pieces by score).
    vocab, from_json = None, False
    if (src.path / "tokenizer.model").is_file():
        try:
            vocab = gguf.vocab.SentencePieceVocab(src.path)
        except Exception:  # noqa: BLE001 - not a SentencePiece model (transformers writes other files there)
            vocab = None
    if vocab is None:
        try:
            vocab, from_json = gguf.vocab.LlamaHfVocab(src.path), True
        except Exception as exc:  # noqa: BLE001
            raise GGUFExportError(f"the tokenizer of {src.path} is neither byte-level BPE nor SentencePiece; "
                                  f"cannot write it to GGUF ({exc})") from exc
    tokens, scores, types = [], [], []
    for text, score, ttype in vocab.all_tokens():
        if from_json and ttype == gguf.TokenType.NORMAL:
            score = -float(len(tokens))
        tokens.append(text)
        scores.append(score)
        types.append(ttype)
    while len(tokens) < vocab_size:
        tokens.append(f"[PAD{len(tokens)}]".encode())
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    if len(tokens) > vocab_size:
        raise GGUFExportError(f"the tokenizer has {len(tokens)} tokens, more than the model's vocabulary ({vocab_size})")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(str(src.path), n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
    # Whether a space is put before the text: llama.cpp's default is yes, transformers' depends
    # on the tokenizer's legacy/prepend settings; write what transformers does.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src.path), **tokenizer_kwargs(src.path))
    pieces = tok.convert_ids_to_tokens(tok("a", add_special_tokens=False)["input_ids"])
    space_prefix = bool(pieces) and pieces[0].startswith("\u2581")
    writer.add_add_space_prefix(space_prefix)
    flags = _add_special_flags(writer, tok, special)
    return {"source": "tokenizer.json" if from_json else "tokenizer.model", "model": "llama", "pre": "default", "pre_recognised": True,
            "special_ids": dict(special.special_token_ids), "add_special": {**special.add_special_token, **flags},
            "add_space_prefix": space_prefix, "chat_template": special.chat_template is not None}


def model_name(src: ExportSource) -> str:
    """general.name: the source folder's name. llama.cpp keys Phi-3 tokenizer quirks on a name containing
    "phi3"/"phi-3" and then requires </s>, <unk>, <s> and <|endoftext|> in the vocabulary (it fails to
    load otherwise), so such a name is only written when the vocabulary has them."""
    name = src.path.resolve().name
    if any(k in name.lower() for k in ("phi3", "phi-3")):
        from transformers import AutoTokenizer

        vocab = AutoTokenizer.from_pretrained(str(src.path), **tokenizer_kwargs(src.path)).get_vocab()
        if not all(t in vocab for t in ("</s>", "<unk>", "<s>", "<|endoftext|>")):
            name = name.lower().replace("phi-3", "phi 3").replace("phi3", "phi 3")
    return name
