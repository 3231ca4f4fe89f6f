"""GGUF metadata: the architecture's hyperparameters as llama.cpp's loader reads them.

What differs between architectures is data (``models.architectures``' ``GGUFLayout``): which keys
llama.cpp expects, which rope scalings the writer translates, Gemma 3's per-layer attention.
A configuration llama.cpp would compute differently is refused, not written.
"""

from __future__ import annotations

import math

import numpy as np

from ..models.architectures import Architecture
from .errors import GGUFExportError


def hparam(config, name, default=None):
    value = getattr(config, name, None)
    return default if value is None else value


def rope_parameters(config, layer_type: str = "full_attention") -> dict:
    """The rotary settings of ``layer_type``'s layers as one dict (``rope_theta``, ``rope_type`` and the
    scaling's fields), from either transformers 5's ``rope_parameters`` (one dict, or one per layer type
    where the layers differ: Gemma 3's sliding layers have their own base) or 4.x's ``rope_theta`` +
    ``rope_scaling`` (+ Gemma 3's ``rope_local_base_freq``, whose sliding layers are never scaled)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        nested = {k: v for k, v in params.items() if isinstance(v, dict)}
        if nested:
            chosen = nested.get(layer_type) or nested.get("full_attention") or next(iter(nested.values()))
            return dict(chosen)
        return dict(params)
    if layer_type == "sliding_attention" and hparam(config, "rope_local_base_freq") is not None:
        return {"rope_type": "default", "rope_theta": float(config.rope_local_base_freq)}
    out = dict(getattr(config, "rope_scaling", None) or {})
    out["rope_theta"] = hparam(config, "rope_theta", 10000.0)
    return out


def rope(config, layer_type: str = "full_attention") -> tuple[float, dict | None]:
    """(rotary base, the scaling dict or None when unscaled) of ``layer_type``'s layers."""
    params = rope_parameters(config, layer_type)
    theta = float(params.get("rope_theta", 10000.0))
    kind = str(params.get("rope_type") or params.get("type") or "default").lower()
    return theta, (params if kind != "default" else None)


def head_dim(config) -> int:
    return int(hparam(config, "head_dim", config.hidden_size // config.num_attention_heads))


def llama3_rope_factors(config, scaling: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for Llama 3.x's "llama3" rope scaling."""
    theta, _ = rope(config)
    dim = head_dim(config)
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


def rope_dims(config) -> int:
    """The rotated dimensions of a head (Phi-3's partial_rotary_factor)."""
    return int(head_dim(config) * float(hparam(config, "partial_rotary_factor", 1.0)))


def add_longrope(writer, c, scaling: dict) -> list:
    """Phi-3/3.5's LongRoPE ("su" in older configs) as convert_hf_to_gguf.py's Phi3MiniModel writes it:
    rope_factors_long/short (fp32, rope dims / 2 each), rope.scaling.original_context_length and
    rope.scaling.attn_factor; the context length written is max_position_embeddings.

    The attention factor is the one transformers applies to cos/sin (_compute_longrope_parameters):
    the config's explicit attention_factor, else sqrt(1 + ln(scale) / ln(original context)) for
    scale = max_position_embeddings / original_max_position_embeddings > 1, else 1.0 (the converter's
    formula for 'su'/'longrope'; for an explicit value llama.cpp's converter would write that formula's,
    here transformers' is written). Where the installed transformers computes a different attention
    factor for the config, the export is refused.

    Which factors apply is decided at run time, differently: llama.cpp uses the short factors while its
    context (n_ctx per sequence) is at most the original context and the long ones beyond; transformers
    by the sequence's length. They differ only when llama.cpp's context exceeds the original one and a
    sequence does not (llama.cpp: long factors, transformers: short)."""
    dims = rope_dims(c)
    long_factors, short_factors = scaling.get("long_factor"), scaling.get("short_factor")
    for which, factors in (("long_factor", long_factors), ("short_factor", short_factors)):
        if factors is None:
            raise GGUFExportError(f"rope_scaling of type longrope has no {which}: llama.cpp needs both the long "
                                  "and the short factors; cannot export")
        try:
            values = np.asarray(factors, dtype=np.float64)
        except (TypeError, ValueError):
            values = None
        if values is None or values.ndim != 1 or len(values) != dims // 2 or dims % 2:
            raise GGUFExportError(f"rope_scaling.{which} must be {dims // 2} numbers (rotary dimensions {dims} / 2), "
                                  f"got {len(factors) if isinstance(factors, (list, tuple)) else factors!r}; "
                                  "cannot export")
        if not np.all(np.isfinite(values)) or np.any(values <= 0):
            raise GGUFExportError(f"rope_scaling.{which} must be positive finite numbers; cannot export")
    max_pos = hparam(c, "max_position_embeddings")
    orig = hparam(c, "original_max_position_embeddings")
    in_scaling = scaling.get("original_max_position_embeddings")
    if orig is None:
        orig = in_scaling
    elif in_scaling is not None and int(in_scaling) != int(orig):
        raise GGUFExportError(f"rope_scaling.original_max_position_embeddings ({in_scaling}) differs from "
                              f"config.original_max_position_embeddings ({orig}); cannot tell which the model uses")
    if max_pos is None or orig is None or int(orig) <= 0:
        raise GGUFExportError("longrope needs max_position_embeddings and original_max_position_embeddings: llama.cpp "
                              "chooses the long or short factors by the original context; cannot export")
    max_pos, orig = int(max_pos), int(orig)
    scale = max_pos / orig
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
    elif not (isinstance(attention, (int, float)) and math.isfinite(attention) and attention > 0):
        raise GGUFExportError(f"rope_scaling.attention_factor must be a positive number, got {attention!r}")
    theirs = transformers_longrope_attention(c)
    if theirs is not None and not math.isclose(theirs, float(attention), rel_tol=1e-6):
        raise GGUFExportError(f"transformers scales this model's rotary embedding by {theirs:.6g}, not the "
                              f"{float(attention):.6g} llama.cpp would be given; cannot export")
    writer.add_rope_scaling_orig_ctx_len(orig)
    writer.add_rope_scaling_attn_factors(float(attention))
    return [("rope_factors_long.weight", np.asarray(long_factors, dtype=np.float32)),
            ("rope_factors_short.weight", np.asarray(short_factors, dtype=np.float32))]


def transformers_longrope_attention(c) -> float | None:
    """The attention factor transformers' _compute_longrope_parameters gives config ``c`` (None where
    ``c`` is not a transformers config or the function is not there as it is in transformers 4.x)."""
    try:
        from transformers import PretrainedConfig
        from transformers.modeling_rope_utils import _compute_longrope_parameters
    except ImportError:
        return None
    if not isinstance(c, PretrainedConfig):
        return None
    try:
        return float(_compute_longrope_parameters(c, "cpu")[1])
    except (TypeError, KeyError, AttributeError, ValueError) as exc:
        raise GGUFExportError(f"transformers cannot compute this model's longrope parameters ({exc}); "
                              "cannot export") from exc


def add_hparams(writer, c, arch: Architecture, ftype) -> list:
    """Architecture metadata of config ``c``; returns extra (name, array) tensors (rope_freqs,
    rope_factors_long/short)."""
    import gguf

    layout = arch.gguf
    writer.add_context_length(int(hparam(c, "max_position_embeddings", 2048)))
    writer.add_embedding_length(int(c.hidden_size))
    writer.add_block_count(int(c.num_hidden_layers))
    writer.add_feed_forward_length(int(c.intermediate_size))
    writer.add_head_count(int(c.num_attention_heads))
    writer.add_head_count_kv(int(hparam(c, "num_key_value_heads", c.num_attention_heads)))
    writer.add_layer_norm_rms_eps(float(hparam(c, "rms_norm_eps", 1e-6)))
    writer.add_vocab_size(int(c.vocab_size))
    hdim = head_dim(c)
    if hdim != c.hidden_size // c.num_attention_heads or layout.key_length:
        writer.add_key_length(hdim)
        writer.add_value_length(hdim)
    if layout.rope_dimension_count:
        writer.add_rope_dimension_count(rope_dims(c))
    if layout.sliding_window and hparam(c, "sliding_window"):
        writer.add_sliding_window(int(c.sliding_window))
    if layout.layer_types:
        add_layer_types(writer, c, hdim)
    theta, scaling = rope(c)
    writer.add_rope_freq_base(theta)
    extra = []
    if scaling:
        kind = str(scaling.get("rope_type") or scaling.get("type") or "default").lower()
        if kind not in layout.rope_scaling:
            raise GGUFExportError(f"rope scaling '{kind}' of this {arch.model_type} model is not supported by the "
                                  "GGUF writer yet")
        if kind == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(scaling["factor"]))
        elif kind == "llama3":
            extra.append(("rope_freqs.weight", llama3_rope_factors(c, scaling)))
        elif kind in ("longrope", "su"):
            extra.extend(add_longrope(writer, c, scaling))
    writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return extra


def add_layer_types(writer, c, head_dim: int) -> None:
    """Gemma 3's per-layer attention (sliding or full) and what llama.cpp assumes of the rest.

    llama.cpp's gemma3 reads the sliding layers from a per-layer flag array (its default is every
    sixth layer full), their rotary base from rope.freq_base_swa, and scales queries by
    1/sqrt(head_dim) (a 62-layer model, which it takes for the 27B, by hidden // heads) with no
    attention soft-capping; a model that differs on those is refused rather than written to
    compute something else."""
    types = list(hparam(c, "layer_types", []) or [])
    if len(types) != int(c.num_hidden_layers) or not set(types) <= {"sliding_attention", "full_attention"}:
        raise GGUFExportError(f"config.layer_types ({types}) does not give 'sliding_attention' or 'full_attention' "
                              f"for each of the {c.num_hidden_layers} layers")
    if hparam(c, "attn_logit_softcapping") is not None:
        raise GGUFExportError("attention logit soft-capping is not computed by llama.cpp's gemma3; cannot export")
    scalar = hparam(c, "query_pre_attn_scalar", head_dim)
    if int(c.num_hidden_layers) == 62:  # llama.cpp takes a 62-layer gemma3 for the 27B: hidden // heads
        expected, which = int(c.hidden_size) // int(c.num_attention_heads), "hidden_size // heads (its 27B rule)"
    else:
        expected, which = head_dim, "head_dim"
    if float(scalar) != float(expected):
        raise GGUFExportError(f"query_pre_attn_scalar {scalar} differs from {which} {expected}: llama.cpp's gemma3 "
                              f"scales queries by 1/sqrt({which}); cannot export")
    if hparam(c, "final_logit_softcapping"):
        writer.add_final_logit_softcapping(float(c.final_logit_softcapping))
    sliding = [t == "sliding_attention" for t in types]
    if any(sliding) and not hparam(c, "sliding_window"):
        raise GGUFExportError("config.layer_types has sliding-attention layers but config.sliding_window is unset")
    if hparam(c, "sliding_window"):  # written above; without the flags llama.cpp would assume its default
        writer.add_sliding_window_pattern(sliding)
        swa_theta, swa_scaling = rope(c, "sliding_attention")
        if swa_scaling is not None:
            raise GGUFExportError("the sliding-attention layers' rotary embedding is scaled; llama.cpp's gemma3 scales "
                                  "only the full-attention layers; cannot export")
        writer.add_rope_freq_base_swa(swa_theta)
