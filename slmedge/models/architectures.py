"""What each supported architecture needs, as data.

Algorithms never ask "is this a Gemma?": they read the entry of the model's ``model_type``.
One default describes the Llama family (SmolLM2, Llama 3.x, Mistral, Qwen2/2.5, Qwen3); the
other entries are small overrides of it. ``gguf`` says how llama.cpp expects the architecture in
a GGUF file (None: the GGUF writer refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class AWQMapping:
    """AWQ scales the inputs of ``linears`` and folds the inverse into ``prev``.

    ``prev`` is a norm (its weight is divided by the scales) or a linear (its output rows are
    divided).  ``inspect`` is the module whose output must stay close while searching scales:
    the smallest module that contains every consumer of the scaled activations.
    """

    prev: str
    linears: tuple[str, ...]
    inspect: str
    # Whether ``inspect`` treats tokens independently (an MLP, a linear): then the search
    # loss can use any subset of tokens; attention needs whole sequences.
    tokenwise: bool = True


@dataclass(frozen=True)
class GGUFLayout:
    """How an architecture is written as GGUF: llama.cpp's architecture (its tensor names come from
    the ``gguf`` package's map for it) and what llama.cpp's loader of it expects."""

    arch: str  # gguf.MODEL_ARCH member name
    # (linear, config attribute holding its head count): rows permuted for llama.cpp's
    # interleaved rotary (convert_hf_to_gguf.py LlamaModel.permute).
    permute: tuple[tuple[str, str], ...] = ()
    # Write {arch}.rope.dimension_count (llama.cpp's llama arch reads it).
    rope_dimension_count: bool = False
    # HF rope_scaling types the writer translates (others are refused).
    rope_scaling: tuple[str, ...] = ("default",)
    # llama.cpp requires an output tensor even when HF ties it to the embedding (Phi-3).
    output_required: bool = False
    # Write {arch}.attention.sliding_window from config.sliding_window.
    sliding_window: bool = False
    # Sliding-window layers as config.layer_types says, one flag per layer, and the rotary base
    # of those layers (config.rope_local_base_freq) — Gemma 3.
    layer_types: bool = False
    # Write attention.key_length/value_length even when head_dim is hidden // heads (Qwen3).
    key_length: bool = False


_LLAMA_PERMUTE = (("self_attn.q_proj", "num_attention_heads"), ("self_attn.k_proj", "num_key_value_heads"))


@dataclass(frozen=True)
class Architecture:
    model_type: str
    # Module paths from the CausalLM root.
    layers: str = "model.layers"
    embed_tokens: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    # Linears of one decoder block, in the order the forward pass reaches them. GPTQ and
    # SparseGPT's "true sequential" mode compresses one group, then collects the next group's
    # statistics on the already-compressed earlier groups.
    sequential: tuple[tuple[str, ...], ...] = (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    )
    awq: tuple[AWQMapping, ...] = (
        AWQMapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn", False),
        # Only where v_proj's outputs are o_proj's inputs one to one (no grouped-query
        # attention): the engine skips a linear->linear mapping whose shapes disagree.
        AWQMapping("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
        AWQMapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        AWQMapping("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    )
    # Linears whose outputs feed attention scores: AWQ's clip search minimises the linear's
    # output error, which says little there, so it leaves them alone (as llm-awq does).
    awq_skip_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")
    # Gemma's RMSNorm multiplies by (1 + weight): folding a scale s into it means
    # (1 + w') = (1 + w) / s; the GGUF writer adds it to every ``*norm.weight`` (llama.cpp's
    # RMSNorm multiplies by the weight).
    norm_offset: float = 0.0
    # The GGUF layout (None: not written as GGUF).
    gguf: GGUFLayout | None = GGUFLayout("LLAMA", _LLAMA_PERMUTE, True, ("default", "linear", "llama3"))
    # Families users know the architecture by (for messages and docs).
    examples: tuple[str, ...] = field(default_factory=tuple)

    @property
    def linear_names(self) -> tuple[str, ...]:
        return tuple(name for group in self.sequential for name in group)


_LLAMA = Architecture("llama", examples=("SmolLM2", "Llama 3.2"))

_GEMMA_AWQ = (
    AWQMapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn", False),
    AWQMapping("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    # Gemma 2/3 normalise the attention output (post_attention_layernorm) before the
    # residual add; the MLP is fed by pre_feedforward_layernorm.
    AWQMapping("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    AWQMapping("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)

ARCHITECTURES: dict[str, Architecture] = {
    "llama": _LLAMA,
    "mistral": replace(_LLAMA, model_type="mistral", examples=("Mistral 7B",),
                       gguf=replace(_LLAMA.gguf, rope_scaling=("default", "linear"))),
    # Qwen2/Qwen3 use NEOX rotary in llama.cpp: no q/k permutation.
    "qwen2": replace(_LLAMA, model_type="qwen2", examples=("Qwen2", "Qwen2.5"), gguf=GGUFLayout("QWEN2")),
    "qwen3": replace(_LLAMA, model_type="qwen3", examples=("Qwen3",), gguf=GGUFLayout("QWEN3", key_length=True)),
    "phi3": replace(
        _LLAMA,
        model_type="phi3",
        sequential=(("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
        # Fused qkv/gate_up: only the norm->fused-linear mappings keep the function intact.
        awq=(
            AWQMapping("input_layernorm", ("self_attn.qkv_proj",), "self_attn", False),
            AWQMapping("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
        ),
        awq_skip_clip=("self_attn.qkv_proj",),
        examples=("Phi-3", "Phi-3.5"),
        # Fused qkv_proj/gate_up_proj are llama.cpp's attn_qkv/ffn_up as they are; NEOX rotary.
        # LongRoPE (Phi-3.5, Phi-3 128k; "su" in older configs): rope_factors_long/short tensors.
        gguf=GGUFLayout("PHI3", rope_dimension_count=True, rope_scaling=("default", "longrope", "su"),
                        output_required=True, sliding_window=True),
    ),
    "gemma2": replace(_LLAMA, model_type="gemma2", awq=_GEMMA_AWQ, norm_offset=1.0, examples=("Gemma 2",), gguf=None),
    "gemma3_text": replace(
        _LLAMA, model_type="gemma3_text", awq=_GEMMA_AWQ, norm_offset=1.0, examples=("Gemma 3 (text)",),
        # NEOX rotary; embeddings scaled by sqrt(hidden) inside llama.cpp as in transformers.
        gguf=GGUFLayout("GEMMA3", rope_scaling=("default", "linear"), sliding_window=True, layer_types=True),
    ),
}


def supported() -> str:
    return ", ".join(
        f"{key} ({', '.join(arch.examples)})" if arch.examples else key for key, arch in ARCHITECTURES.items()
    )


def architecture_for(config) -> Architecture:
    """The table entry for a transformers config, or a clear refusal."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture '{model_type}' is not supported; supported: {supported()}"
        )
    return ARCHITECTURES[model_type]


def exact_attention(model):
    """``model`` computing attention as its configuration says: a config with attention logit soft-capping
    (Gemma 2) gets the eager implementation, the only one of transformers' that applies the cap (its default,
    sdpa, leaves it out; llama.cpp applies it). Returns the model."""
    if getattr(model.config, "attn_logit_softcapping", None) and \
            getattr(model.config, "_attn_implementation", None) != "eager":
        model.set_attn_implementation("eager")
    return model

