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


def rope(config) -> tuple[float, dict | None]:
    params = getattr(config, "rope_parameters", None) or {}
    theta = hparam(config, "rope_theta", params.get("rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None) or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    return float(theta), scaling


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


def add_hparams(writer, c, arch: Architecture, ftype) -> list:
    """Architecture metadata of config ``c``; returns extra (name, array) tensors (rope_freqs)."""
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
        writer.add_rope_dimension_count(int(hdim * float(hparam(c, "partial_rotary_factor", 1.0))))
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
        writer.add_rope_freq_base_swa(float(hparam(c, "rope_local_base_freq", 10000.0)))
