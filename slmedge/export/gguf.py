"""GGUF export on the ``gguf`` package's writer: the artifact's integer codes become GGUF blocks.

GGUF blocks hold 32 consecutive values along the input dimension. Where the artifact's grid
fits a block type (every 32-block inside one group), the codes are placed as they are, so the
GPTQ/AWQ calibration reaches llama.cpp unchanged (DESIGN.md "numeric contracts"):

- Q4_0 ``x = d*(n-8)``: symmetric codes of up to 4 bits, ``n = q - zero + 8``, ``d = scale``;
- Q4_1 ``x = d*n + m``: any codes of up to 4 bits, ``n = q``, ``d = scale``, ``m = -scale*zero``
  (m rounded to fp16: the only value that is not carried exactly);
- Q8_0 ``x = d*n``: symmetric codes of up to 8 bits, ``n = q - zero`` as int8.

Scales are already fp16 in the artifact, so Q4_0/Q8_0 blocks decode to exactly the artifact's
weights. Any other combination is re-quantized by llama.cpp's own quantizer
(``llama_model_quantize``) from the artifact's dequantized weights, with a warning that the
calibrated grid is not kept. Pruned models are written dense.

Llama-family models need the q/k rows permuted for llama.cpp's rotary layout (pairs (i, i+d/2)
of the HF "rotate_half" layout become adjacent); Qwen2/Qwen3 use NEOX rotary in llama.cpp and
need none. Codes, scales and zero points are permuted together: rows are output features.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..compress.artifact import MANIFEST, Artifact
from ..compress.quant import QuantSpec
from ..errors import OutputExistsError, UnsupportedArchitectureError
from ..fsutil import sha256_file
from ..models.source import tokenizer_kwargs
from . import ExportError, GGUFExportError, GGUFVerificationError
from .source import iter_weights, open_export_source


BLOCK = 32  # values per block along the input dimension, for every type written here


# --- tables -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFArch:
    """How one HF ``model_type`` is written: llama.cpp's architecture and its rotary layout."""

    model_type: str
    arch: str  # gguf.MODEL_ARCH member name
    # (linear, config attribute holding its head count): rows permuted for llama.cpp's
    # interleaved rotary (convert_hf_to_gguf.py LlamaModel.permute).
    permute: tuple[tuple[str, str], ...] = ()
    # Write {arch}.rope.dimension_count (llama.cpp's llama arch reads it).
    rope_dimension_count: bool = False
    # HF rope_scaling types this writer translates (others are refused).
    rope_scaling: tuple[str, ...] = ("default",)
    # llama.cpp requires an output tensor even when HF ties it to the embedding (Phi-3).
    output_required: bool = False
    # Write {arch}.attention.sliding_window from config.sliding_window.
    sliding_window: bool = False
    # Added to every ``*norm.weight`` (Gemma's RMSNorm multiplies by 1 + weight; llama.cpp's by weight).
    norm_offset: float = 0.0
    # Sliding-window layers as config.layer_types says, one flag per layer, and the rotary base
    # of those layers (config.rope_local_base_freq) — Gemma 3.
    layer_types: bool = False


_LLAMA_PERMUTE = (("self_attn.q_proj", "num_attention_heads"), ("self_attn.k_proj", "num_key_value_heads"))

GGUF_ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", "LLAMA", _LLAMA_PERMUTE, True, ("default", "linear", "llama3")),
    "mistral": GGUFArch("mistral", "LLAMA", _LLAMA_PERMUTE, True, ("default", "linear")),
    "qwen2": GGUFArch("qwen2", "QWEN2", (), False, ("default",)),
    "qwen3": GGUFArch("qwen3", "QWEN3", (), False, ("default",)),
    # Phi-3: fused qkv_proj/gate_up_proj are llama.cpp's attn_qkv/ffn_up as they are; NEOX rotary.
    "phi3": GGUFArch("phi3", "PHI3", (), True, ("default",), output_required=True, sliding_window=True),
    # Gemma 3 (text): NEOX rotary; embeddings scaled by sqrt(hidden) inside llama.cpp as in transformers.
    "gemma3_text": GGUFArch("gemma3_text", "GEMMA3", (), False, ("default", "linear"), sliding_window=True,
                            norm_offset=1.0, layer_types=True),
}

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


@dataclass(frozen=True)
class QType:
    name: str
    ggml: str  # gguf.GGMLQuantizationType member name
    ftype: str  # gguf.LlamaFileType member name
    max_bits: int = 0  # codes of up to this many bits fit (0: not a code-holding type)
    needs_symmetric: bool = False


QTYPES: dict[str, QType] = {
    "f32": QType("f32", "F32", "ALL_F32"),
    "f16": QType("f16", "F16", "MOSTLY_F16"),
    "q8_0": QType("q8_0", "Q8_0", "MOSTLY_Q8_0", 8, True),
    "q4_0": QType("q4_0", "Q4_0", "MOSTLY_Q4_0", 4, True),
    "q4_1": QType("q4_1", "Q4_1", "MOSTLY_Q4_1", 4, False),
    # Written only by llama.cpp's quantizer (no artifact grid maps onto them).
    "q5_0": QType("q5_0", "Q5_0", "MOSTLY_Q5_0"),
    "q5_1": QType("q5_1", "Q5_1", "MOSTLY_Q5_1"),
    "q4_k_s": QType("q4_k_s", "Q4_K", "MOSTLY_Q4_K_S"),
    "q4_k_m": QType("q4_k_m", "Q4_K", "MOSTLY_Q4_K_M"),
    "q5_k_m": QType("q5_k_m", "Q5_K", "MOSTLY_Q5_K_M"),
    "q6_k": QType("q6_k", "Q6_K", "MOSTLY_Q6_K"),
    "q3_k_m": QType("q3_k_m", "Q3_K", "MOSTLY_Q3_K_M"),
    "q2_k": QType("q2_k", "Q2_K", "MOSTLY_Q2_K"),
}
MANIFEST_KEY = "slmedge.manifest"

# Verification tolerances against torch logits of the same weights. llama.cpp multiplies
# quantized weights with 8-bit-quantized activations (and f16 weights in f16), so only f32 is
# near exact. "kept": the codes were placed as they are; "requantized": llama.cpp's quantizer
# chose new values, so the file differs from the artifact by a re-quantization error.
TOLERANCES: dict[str, dict[str, float]] = {
    "f32": {"mean_kl": 1e-4, "top1": 0.97},
    "f16": {"mean_kl": 2e-3, "top1": 0.9},
    "kept": {"mean_kl": 0.05, "top1": 0.8},
    # Loose on purpose: they catch a broken file (wrong layout: KL of several nats, top-1 near
    # 0), not a lossy one; llama.cpp's own q4_0 of SmolLM2-135M measures KL 0.53 on the probe.
    "requantized": {"mean_kl": 1.0, "top1": 0.4},
    "requantized_low_bit": {"mean_kl": 2.0, "top1": 0.25},  # q2_k, q3_k_*
}


# --- codes -> blocks --------------------------------------------------------------------------


def cannot_place(spec: QuantSpec, columns: int, qtype: QType) -> str | None:
    """Why the codes of a ``spec`` grid over ``columns`` inputs cannot be placed in ``qtype``
    blocks as they are (None: they can)."""
    if not qtype.max_bits:
        return f"{qtype.name} holds no integer codes"
    if spec.bits > qtype.max_bits:
        return f"{spec.bits}-bit codes do not fit {qtype.name} ({qtype.max_bits}-bit)"
    if qtype.needs_symmetric and not spec.symmetric:
        return f"asymmetric codes need a zero offset, which {qtype.name} does not have"
    if columns % BLOCK:
        return f"width {columns} is not a multiple of {BLOCK}"
    g = spec.group_width(columns)
    if g % BLOCK and g != columns:
        return f"group size {spec.group_size} is not a multiple of {BLOCK}"
    return None


def codes_to_blocks(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, spec: QuantSpec,
                    qtype: QType) -> np.ndarray:
    """(rows, cols) codes, (rows, G) fp16 scales and zeros -> (rows, nbytes) uint8 GGUF blocks."""
    rows, cols = codes.shape
    nb = cols // BLOCK
    g = spec.group_width(cols)
    gidx = (np.arange(nb) * BLOCK) // g  # the group of each block (blocks never straddle groups)
    d = np.asarray(scales, dtype=np.float16)[:, gidx]  # (rows, nb)
    z = np.asarray(zeros, dtype=np.int16)[:, gidx][:, :, None]
    q = np.asarray(codes, dtype=np.int16).reshape(rows, nb, BLOCK)
    d_bytes = d.reshape(rows, nb, 1).view(np.uint8)  # (rows, nb, 2)
    if qtype.name == "q8_0":
        n = (q - z).astype(np.int8).view(np.uint8)
        parts = [d_bytes, n]
    else:
        if qtype.name == "q4_0":
            n = (q - z + 8).astype(np.uint8)
            head = [d_bytes]
        else:  # q4_1
            m = (-(d.astype(np.float32) * z[:, :, 0].astype(np.float32))).astype(np.float16)
            n = q.astype(np.uint8)
            head = [d_bytes, m.reshape(rows, nb, 1).view(np.uint8)]
        # llama.cpp's layout: byte j holds element j (low nibble) and element j+16 (high nibble).
        packed = n[:, :, : BLOCK // 2] | (n[:, :, BLOCK // 2 :] << 4)
        parts = [*head, packed.astype(np.uint8)]
    return np.ascontiguousarray(np.concatenate(parts, axis=2).reshape(rows, -1))


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py LlamaModel.permute), any trailing dims."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- source -----------------------------------------------------------------------------------


@dataclass
class _Source:
    path: Path
    artifact: Artifact | None
    config: object
    arch: GGUFArch
    layers: dict = field(default_factory=dict)


def _open_source(source) -> _Source:
    try:
        base = open_export_source(source)
    except ExportError as exc:
        raise GGUFExportError(str(exc)) from exc
    if base.model_type not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF export does not support architecture '{base.model_type}' yet; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)}")
    return _Source(base.path, base.artifact, base.config, GGUF_ARCHITECTURES[base.model_type], base.layers)


def _hparam(config, name, default=None):
    value = getattr(config, name, None)
    return default if value is None else value


def _rope(config) -> tuple[float, dict | None]:
    params = getattr(config, "rope_parameters", None) or {}
    theta = _hparam(config, "rope_theta", params.get("rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None) or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    return float(theta), scaling


def _head_dim(config) -> int:
    return int(_hparam(config, "head_dim", config.hidden_size // config.num_attention_heads))


def _llama3_rope_factors(config, scaling: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for Llama 3.x's "llama3" rope scaling."""
    theta, _ = _rope(config)
    dim = _head_dim(config)
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = scaling.get("factor", 8.0)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# --- metadata ---------------------------------------------------------------------------------


def _add_hparams(writer, src: _Source, ftype) -> list:
    """Architecture metadata; returns extra (name, array) tensors (rope_freqs)."""
    import gguf

    c = src.config
    writer.add_context_length(int(_hparam(c, "max_position_embeddings", 2048)))
    writer.add_embedding_length(int(c.hidden_size))
    writer.add_block_count(int(c.num_hidden_layers))
    writer.add_feed_forward_length(int(c.intermediate_size))
    writer.add_head_count(int(c.num_attention_heads))
    writer.add_head_count_kv(int(_hparam(c, "num_key_value_heads", c.num_attention_heads)))
    writer.add_layer_norm_rms_eps(float(_hparam(c, "rms_norm_eps", 1e-6)))
    writer.add_vocab_size(int(c.vocab_size))
    head_dim = _head_dim(c)
    if head_dim != c.hidden_size // c.num_attention_heads or src.arch.model_type == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if src.arch.rope_dimension_count:
        writer.add_rope_dimension_count(int(head_dim * float(_hparam(c, "partial_rotary_factor", 1.0))))
    if src.arch.sliding_window and _hparam(c, "sliding_window"):
        writer.add_sliding_window(int(c.sliding_window))
    if src.arch.layer_types:
        _add_layer_types(writer, c, head_dim)
    theta, scaling = _rope(c)
    writer.add_rope_freq_base(theta)
    extra = []
    if scaling:
        kind = str(scaling.get("rope_type") or scaling.get("type") or "default").lower()
        if kind not in src.arch.rope_scaling:
            raise GGUFExportError(f"rope scaling '{kind}' of this {src.arch.model_type} model is not supported by the "
                                  "GGUF writer yet")
        if kind == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(scaling["factor"]))
        elif kind == "llama3":
            extra.append(("rope_freqs.weight", _llama3_rope_factors(c, scaling)))
    writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return extra


def _add_layer_types(writer, c, head_dim: int) -> None:
    """Gemma 3's per-layer attention (sliding or full) and what llama.cpp assumes of the rest.

    llama.cpp's gemma3 reads the sliding layers from a per-layer flag array (its default is every
    sixth layer full), their rotary base from rope.freq_base_swa, and scales queries by
    1/sqrt(head_dim) (a 62-layer model, which it takes for the 27B, by hidden // heads) with no
    attention soft-capping; a model that differs on those is refused rather than written to
    compute something else."""
    types = list(_hparam(c, "layer_types", []) or [])
    if len(types) != int(c.num_hidden_layers) or not set(types) <= {"sliding_attention", "full_attention"}:
        raise GGUFExportError(f"config.layer_types ({types}) does not give 'sliding_attention' or 'full_attention' "
                              f"for each of the {c.num_hidden_layers} layers")
    if _hparam(c, "attn_logit_softcapping") is not None:
        raise GGUFExportError("attention logit soft-capping is not computed by llama.cpp's gemma3; cannot export")
    scalar = _hparam(c, "query_pre_attn_scalar", head_dim)
    if int(c.num_hidden_layers) == 62:  # llama.cpp takes a 62-layer gemma3 for the 27B: hidden // heads
        expected, which = int(c.hidden_size) // int(c.num_attention_heads), "hidden_size // heads (its 27B rule)"
    else:
        expected, which = head_dim, "head_dim"
    if float(scalar) != float(expected):
        raise GGUFExportError(f"query_pre_attn_scalar {scalar} differs from {which} {expected}: llama.cpp's gemma3 "
                              f"scales queries by 1/sqrt({which}); cannot export")
    if _hparam(c, "final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(c.final_logit_softcapping))
    sliding = [t == "sliding_attention" for t in types]
    if any(sliding) and not _hparam(c, "sliding_window"):
        raise GGUFExportError("config.layer_types has sliding-attention layers but config.sliding_window is unset")
    if _hparam(c, "sliding_window"):  # written above; without the flags llama.cpp would assume its default
        writer.add_sliding_window_pattern(sliding)
        writer.add_rope_freq_base_swa(float(_hparam(c, "rope_local_base_freq", 10000.0)))


# --- tokenizer --------------------------------------------------------------------------------


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


def _base_gguf(src: _Source) -> Path | None:
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
        candidates.append(Path(base["path"]))
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


def _add_tokenizer(writer, src: _Source) -> dict:
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
    if model.get("type") != "BPE" or model.get("byte_fallback"):
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


def _add_sentencepiece(writer, src: _Source, vocab_size: int) -> dict:
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


# --- llama.cpp's quantizer --------------------------------------------------------------------


def llamacpp_quantize(src_path: Path, dst_path: Path, qtype: QType, n_threads: int | None = None) -> None:
    from ..models.gguf_check import quiet_native_stderr
    from ..models.source import require_llama_cpp

    llama_cpp = require_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{qtype.ftype}")
    params.nthread = n_threads or max(1, os.cpu_count() or 1)
    params.allow_requantize = False  # tensors already holding codes are copied, never re-quantized
    with quiet_native_stderr():
        rc = llama_cpp.llama_model_quantize(str(src_path).encode(), str(dst_path).encode(), params)
    if rc != 0:
        raise GGUFExportError(f"llama.cpp's quantizer failed ({rc}) to write {qtype.name}")


# --- verification -----------------------------------------------------------------------------


def verify_against_torch(gguf_path: Path, src: _Source, tolerance: dict, probe: str | None = None,
                         n_threads: int | None = None, tokenizer_copied: bool = False) -> dict:
    """llama.cpp's logits of the file against torch's of the source weights on a short probe."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models.gguf_check import PROBE, compare_logits, llamacpp_logits, vocab_only

    probe = PROBE if probe is None else probe
    tok = AutoTokenizer.from_pretrained(str(src.path), **tokenizer_kwargs(src.path))
    ids = tok(probe, add_special_tokens=False)["input_ids"]
    try:
        with vocab_only(gguf_path) as llm:
            cpp_ids = list(llm.tokenize(probe.encode("utf-8"), add_bos=False, special=False))
            add_bos = bool(llm._model.add_bos_token()) if hasattr(llm, "_model") else False
            bos = llm.token_bos()
    except ValueError as exc:
        raise GGUFVerificationError(f"llama.cpp cannot load the written GGUF ({exc}); nothing was written") from exc
    same_tokens = cpp_ids == list(ids)
    if not same_tokens and not tokenizer_copied:
        first = next((i for i, (a, b) in enumerate(zip(ids, cpp_ids)) if a != b), min(len(ids), len(cpp_ids)))
        raise GGUFVerificationError(
            f"llama.cpp tokenizes the probe differently from transformers (first difference at token {first}); "
            "the GGUF's tokenizer metadata is wrong for this model")
    if add_bos and bos is not None and bos >= 0:
        ids = [bos, *ids]
    model = AutoModelForCausalLM.from_pretrained(str(src.path), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float().numpy()
    del model
    cpp = llamacpp_logits(gguf_path, ids, n_threads=n_threads)
    stats = compare_logits(ref, cpp)
    stats["tokenizer_agrees"] = same_tokens
    stats["tolerance"] = dict(tolerance)
    if stats["mean_kl"] > tolerance["mean_kl"] or stats["top1_agreement"] < tolerance["top1"]:
        raise GGUFVerificationError(
            f"llama.cpp's logits of the GGUF disagree with torch's of {src.path.name} (mean KL {stats['mean_kl']:.2e} "
            f"> {tolerance['mean_kl']:g} or top-1 agreement {stats['top1_agreement']:.0%} < {tolerance['top1']:.0%}); "
            "nothing was written")
    return stats


# --- the export -------------------------------------------------------------------------------


def _auto_qtype(layers: dict) -> str:
    """The smallest type that holds every layer's codes as they are; else the commonest natural one."""
    coded = [res for res in layers.values() if res.codes is not None]
    if not coded:
        return "f16"
    for name in ("q4_0", "q4_1", "q8_0"):
        if all(cannot_place(r.spec, r.codes.shape[1], QTYPES[name]) is None for r in coded):
            return name
    counts: dict[str, int] = {}
    for res in coded:
        s = res.spec
        name = ("q4_0" if s.symmetric else "q4_1") if s.bits <= 4 else "q8_0"
        counts[name] = counts.get(name, 0) + 1
    return max(counts, key=counts.get)


def _model_name(src: _Source) -> str:
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


def _tmp_name(out: Path, tag: str = "") -> Path:
    return out.with_name(f".slmedge-tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}{tag}-{out.name}")


def export_gguf(source, out_path, qtype: str = "auto", exact: bool = False, verify: bool = True, *,
                overwrite: bool = False, probe: str | None = None, n_threads: int | None = None,
                keep_f16_uncoded: bool = False) -> dict:
    """Write ``source`` (an slmedge artifact or a plain HF folder) as one GGUF file at ``out_path``.

    ``qtype``: ``auto`` (the type matching the artifact's codes, else f16), ``f32``, ``f16``,
    ``q8_0``, ``q4_0``, ``q4_1``. Codes that fit the type are placed as they are; the rest go
    through llama.cpp's quantizer with a warning (``exact=True`` refuses instead). With
    ``verify``, llama.cpp's logits of the file are compared with torch's of the source and a
    disagreement raises :class:`GGUFVerificationError`. The file appears only when complete and
    verified. Returns a report (types per tensor, which kept their codes, verification stats).
    """
    import gguf

    started = time.perf_counter()
    key = str(qtype).lower()
    if key not in QTYPES and key != "auto":
        raise GGUFExportError(f"unknown GGUF type '{qtype}'; choose auto, {', '.join(QTYPES)}")
    out = Path(out_path)
    if out.exists() and not overwrite:
        raise OutputExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    if out.exists() and not out.is_file():
        raise OutputExistsError(f"{out} exists and is not a file")
    out.parent.mkdir(parents=True, exist_ok=True)
    src = _open_source(source)
    key = _auto_qtype(src.layers) if key == "auto" else key
    target = QTYPES[key]
    arch_enum = gguf.MODEL_ARCH[src.arch.arch]
    c = src.config
    tied = bool(getattr(c, "tie_word_embeddings", False))
    tmap = gguf.get_tensor_name_map(arch_enum, int(c.num_hidden_layers))
    permute = {rel: int(_hparam(c, attr, c.num_attention_heads)) for rel, attr in src.arch.permute}

    # Plan and build every tensor.
    tensors: list[tuple[str, np.ndarray, object]] = []  # (gguf name, data, raw ggml type or None)
    report_tensors: dict[str, dict] = {}
    requant, notes = [], []
    seen_layers = set()
    has_codes = any(r.codes is not None for r in src.layers.values())
    copies: list[tuple[str, np.ndarray]] = []  # a tied head llama.cpp needs as its own tensor

    def weights():
        yield from iter_weights(src.path)
        yield from copies

    for hf_name, w in weights():
        from_copy = hf_name.endswith("#tied")
        hf_name = hf_name.removesuffix("#tied")
        if tied and hf_name == "lm_head.weight" and not from_copy:
            continue
        if tied and src.arch.output_required and hf_name == "model.embed_tokens.weight":
            copies.append(("lm_head.weight#tied", w))
        name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise GGUFExportError(f"tensor {hf_name} has no GGUF name for {src.arch.arch.lower()}; cannot export it")
        if src.arch.norm_offset and hf_name.endswith("norm.weight"):
            w = w + np.float32(src.arch.norm_offset)
        layer, _, suffix = hf_name.rpartition(".")
        heads = next((n for rel, n in permute.items() if layer.endswith("." + rel)), None)
        if heads is not None:
            w = permute_rows(w, heads)
        res = src.layers.get(layer) if suffix == "weight" else None
        if res is not None:
            seen_layers.add(layer)
        info = {"hf_name": hf_name, "shape": list(w.shape), "codes_kept": False}
        if res is not None and res.mask is not None:
            info["sparsity"] = round(1 - float(res.mask.float().mean()), 4)
        if w.ndim == 1 or target.name == "f32":
            tensors.append((name, w.astype(np.float32), None))
            info["type"] = "F32"
        elif target.name == "f16":
            tensors.append((name, w.astype(np.float16), None))
            info["type"] = "F16"
        elif res is not None and res.codes is not None:
            why = cannot_place(res.spec, w.shape[1], target)
            if why is None:
                codes, scales, zeros = res.codes.numpy(), res.scales.numpy(), res.zeros.numpy()
                if heads is not None:
                    codes, scales, zeros = (permute_rows(a, heads) for a in (codes, scales, zeros))
                blocks = codes_to_blocks(codes, scales, zeros, res.spec, target)
                ggml = gguf.GGMLQuantizationType[target.ggml]
                decoded = gguf.quants.dequantize(blocks, ggml)
                tensors.append((name, blocks, ggml))
                info.update(type=target.ggml, codes_kept=True, grid=res.spec.describe(),
                            max_abs_diff=float(np.abs(decoded - w).max()))
            else:
                if exact:
                    raise GGUFExportError(f"{layer}'s codes ({res.spec.describe()}) cannot be kept as {target.name}: "
                                          f"{why}; rerun without exact to let llama.cpp re-quantize it")
                tensors.append((name, w.astype(np.float32), None))
                info.update(type="F32", grid=res.spec.describe(), requantized_because=why)
                requant.append(name)
        elif has_codes and (keep_f16_uncoded or not target.max_bits):
            # Left unquantized by the recipe (embeddings, lm_head, skipped layers): kept at f16.
            tensors.append((name, w.astype(np.float16), None))
            info["type"] = "F16"
        elif has_codes:
            # Left unquantized by the recipe: llama.cpp's quantizer gives them the type it would give
            # them in its own file of this type (token_embd/output often Q6_K), so sizes compare.
            tensors.append((name, w.astype(np.float32), None))
            info.update(type="F32", uncoded=True)
            requant.append(name)
        else:
            tensors.append((name, w.astype(np.float32), None))
            info["type"] = "F32"
            requant.append(name)
        report_tensors[name] = info
    # A tied lm_head is the embedding tensor itself: written (dequantized) as token_embd.
    missing = {n for n, r in src.layers.items() if r.codes is not None} - seen_layers - ({"lm_head"} if tied else set())
    if missing:
        raise GGUFExportError(f"the artifact has codes for {sorted(missing)[0]} but no such weight")
    if requant and src.artifact is not None and any(report_tensors[n].get("grid") for n in requant):
        msg = (f"{sum(1 for n in requant if report_tensors[n].get('grid'))} linear(s) cannot keep their codes as "
               f"{target.name} and are re-quantized by llama.cpp: their calibration (GPTQ/AWQ grid) is not kept")
        warnings.warn(msg, stacklevel=2)
        notes.append(msg)

    if any(r.mask is not None for r in src.layers.values()):
        notes.append("pruned weights are written dense with their zeros: llama.cpp gains no speed (and no size) "
                     "from unstructured sparsity")
    coded_requant = [n for n in requant if report_tensors[n].get("grid")]
    for name in requant:
        report_tensors[name]["type"] = f"requantized by llama.cpp ({target.name})"
    manifest = {
        "format": "slmedge-gguf-export",
        "source": str(src.path),
        "source_kind": "artifact" if src.artifact is not None else "hf_dir",
        "source_manifest_sha256": sha256_file(src.path / MANIFEST) if src.artifact is not None else None,
        "recipe": (src.artifact.manifest.get("recipe") if src.artifact is not None else None),
        "qtype": target.name,
        "tensors": {n: {k: v for k, v in t.items() if k in ("type", "codes_kept", "grid", "sparsity", "requantized_because")}
                    for n, t in report_tensors.items()},
    }
    ftype = gguf.LlamaFileType[target.ftype]
    tmp = _tmp_name(out)
    stage = _tmp_name(out, "-stage") if requant else None
    try:
        writer = gguf.GGUFWriter(str(stage or tmp), gguf.MODEL_ARCH_NAMES[arch_enum])
        writer.add_name(_model_name(src))
        extra = _add_hparams(writer, src, ftype if not requant else gguf.LlamaFileType.ALL_F32)
        tok_info = _add_tokenizer(writer, src)
        writer.add_string(MANIFEST_KEY, json.dumps(manifest, sort_keys=True, default=str))
        for name, data in extra:
            tensors.append((name, data, None))
            report_tensors[name] = {"type": "F32", "shape": list(data.shape), "codes_kept": False}
        for name, data, raw in tensors:
            writer.add_tensor(name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        if stage is not None:
            llamacpp_quantize(stage, tmp, target, n_threads)
            _check_requantized(tmp, tensors, report_tensors)
        verification = None
        if verify:
            kind = target.name if target.name in ("f32", "f16") else ("kept" if has_codes and not coded_requant else
                                                                       "requantized_low_bit" if target.name[:2] in ("q2", "q3")
                                                                       else "requantized")
            verification = verify_against_torch(tmp, src, TOLERANCES[kind], probe, n_threads,
                                                tokenizer_copied=tok_info["source"].startswith("gguf:"))
        os.replace(tmp, out)
    finally:
        for p in (tmp, stage):
            if p is not None:
                Path(p).unlink(missing_ok=True)
    kept = [n for n, t in report_tensors.items() if t["codes_kept"]]
    return {
        "path": str(out),
        "source": str(src.path),
        "source_kind": "artifact" if src.artifact is not None else "hf_dir",
        "architecture": src.arch.arch.lower(),
        "model_type": src.arch.model_type,
        "qtype": target.name,
        "exact": not coded_requant and src.artifact is not None and bool(kept),
        "codes_kept": len(kept),
        "requantized_by_llamacpp": len(requant),
        "tied_embeddings": tied,
        "qk_permuted": bool(src.arch.permute),
        "tokenizer": tok_info,
        "tensors": report_tensors,
        "bytes": out.stat().st_size,
        "verification": verification,
        "notes": notes,
        "seconds": round(time.perf_counter() - started, 2),
    }


def _check_requantized(path: Path, tensors, report_tensors: dict) -> None:
    """After llama.cpp's quantizer: record final types; the placed codes must be byte-identical."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    placed = {name: data for name, data, raw in tensors if raw is not None}
    for t in reader.tensors:
        info = report_tensors.setdefault(t.name, {"codes_kept": False})
        info["type"] = t.tensor_type.name
        if t.name in placed:
            if not np.array_equal(np.asarray(t.data).reshape(-1), placed[t.name].reshape(-1)):
                raise GGUFExportError(f"llama.cpp's quantizer changed the placed codes of {t.name}")
        elif info.get("codes_kept"):
            info["codes_kept"] = False
