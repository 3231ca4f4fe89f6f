"""A model's shape, read without its weights: what the limits need before anything loads.

The positions a model was trained for bound every length a run asks of it (calibration and
perplexity windows, prompt and generated tokens, context); its layers, heads and vocabulary size
give the memory a run allocates (KV cache, logits, calibration activations). They come from the
``config.json`` of a folder (a Hugging Face folder, an artifact, an ONNX or compressed-tensors
export: the config beside the model file) or from a GGUF file's header (``context_length`` and
the rest of the architecture's keys), never from the weights, so a length past the positions is
refused before the model loads (``slmedge.limits``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

# The config keys that hold the positions, in the order architectures use them (GPT-2 style
# ``n_positions``; some remote-code configs ``seq_length``).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass(frozen=True)
class ModelShape:
    where: str  # the model, for messages (its folder, file or embedded name)
    positions: int | None = None
    positions_from: str = ""  # where the positions were read ("max_position_embeddings in .../config.json")
    layers: int | None = None
    hidden: int | None = None
    intermediate: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    vocab: int | None = None

    def config(self) -> dict:
        """The shape in a Hugging Face config's names (what ``evaluate.system.kv_cache_bytes`` reads)."""
        out = {"num_hidden_layers": self.layers, "hidden_size": self.hidden, "intermediate_size": self.intermediate,
               "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
               "vocab_size": self.vocab, "max_position_embeddings": self.positions}
        return {k: v for k, v in out.items() if v is not None}

    def as_dict(self) -> dict:
        return asdict(self)


def _int(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (list, tuple)):  # per-layer values (head counts): the largest
        value = max((v for v in value if isinstance(v, int) and not isinstance(v, bool)), default=None)
    return int(value) if isinstance(value, (int, float)) and value > 0 else None


def config_shape(config: dict, where: str) -> ModelShape:
    """The shape a Hugging Face ``config.json`` (as a dict) declares; a multimodal config's text part."""
    if isinstance(config.get("text_config"), dict) and not any(k in config for k in POSITION_KEYS):
        config = {**config, **config["text_config"]}
    key = next((k for k in POSITION_KEYS if _int(config.get(k))), None)
    positions = _int(config[key]) if key else None
    heads = _int(config.get("num_attention_heads") or config.get("n_head"))
    hidden = _int(config.get("hidden_size") or config.get("n_embd"))
    head_dim = _int(config.get("head_dim")) or (hidden // heads if hidden and heads else None)
    return ModelShape(where=where, positions=positions, positions_from=f"{key} in {where}/config.json" if key else "",
                      layers=_int(config.get("num_hidden_layers") or config.get("n_layer")),
                      hidden=hidden, intermediate=_int(config.get("intermediate_size")), heads=heads,
                      kv_heads=_int(config.get("num_key_value_heads")) or heads, head_dim=head_dim,
                      vocab=_int(config.get("vocab_size")))


def folder_shape(folder: Path) -> ModelShape | None:
    """The shape of the model in ``folder`` from its config.json; None without a readable one."""
    cfg = Path(folder) / "config.json"
    try:
        config = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config_shape(config, f"{folder}") if isinstance(config, dict) else None


def gguf_shape(path: Path) -> ModelShape | None:
    """The shape a GGUF file's header declares (``<arch>.context_length`` and the rest); None when
    the header cannot be read here (big-endian, truncated: its loader says what is wrong)."""
    from .gguf_seal import header_values

    path = Path(path)
    try:
        arch = header_values(path, ["general.architecture"]).get("general.architecture")
        if not isinstance(arch, str):
            return None
        keys = {k: f"{arch}.{k}" for k in ("context_length", "block_count", "embedding_length", "feed_forward_length",
                                           "attention.head_count", "attention.head_count_kv", "attention.key_length",
                                           "vocab_size")}
        md = header_values(path, [*keys.values(), "tokenizer.ggml.tokens"])
    except (OSError, ValueError):
        return None

    def get(key):
        return _int(md.get(keys[key]))

    heads, hidden = get("attention.head_count"), get("embedding_length")
    return ModelShape(where=path.name, positions=get("context_length"), positions_from=f"{keys['context_length']} of "
                      f"{path.name}", layers=get("block_count"), hidden=hidden,
                      intermediate=get("feed_forward_length"), heads=heads,
                      kv_heads=get("attention.head_count_kv") or heads,
                      head_dim=get("attention.key_length") or (hidden // heads if hidden and heads else None),
                      vocab=get("vocab_size") or _int(md.get("tokenizer.ggml.tokens")))


def path_shape(path: Path) -> ModelShape | None:
    """The shape of a model on disk: a .gguf file's header; a folder's config.json (an HF folder, an
    artifact, an ONNX or compressed-tensors export); another file's (an .onnx) config.json beside it."""
    path = Path(path)
    if path.is_dir():
        found = folder_shape(path)
        if found is None:  # a folder export holding its model one level down (onnxruntime-genai)
            inner = sorted(p for p in path.iterdir() if p.is_dir() and (p / "config.json").is_file())
            found = folder_shape(inner[0]) if len(inner) == 1 else None
        return found
    if path.suffix.lower() == ".gguf":
        return gguf_shape(path)
    if path.is_file():
        return folder_shape(path.parent)
    return None


def model_shape(spec: str | None, revision: str | None = None) -> ModelShape | None:
    """The shape of a model source or export, without loading it; None when it cannot be known
    before loading (a Hub id not in the local cache: it is checked once loaded)."""
    from .source import embedded_gguf_path, resolve

    if spec is not None and Path(str(spec)).expanduser().exists():
        return path_shape(Path(str(spec)).expanduser())
    source = resolve(spec, revision)
    if source.kind == "embedded":
        shape = gguf_shape(embedded_gguf_path(source.spec))
        return None if shape is None else ModelShape(**{**shape.as_dict(), "where": source.spec})
    if source.path is not None:
        return path_shape(source.path)
    return None
