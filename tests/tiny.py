"""Tiny random-weight models, one per architecture in the table, built in the test run.

Nothing comes from a hub: configs are written here, weights are random (seeded), and the
tokenizer is a byte-level BPE trained in milliseconds on a few built-in sentences.
"""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Small language models run on phones, boards and laptops.",
    "Quantization keeps fidelity better than pruning in many languages.",
    "Die Katze schläft auf dem Sofa, während es draußen regnet.",
    "El perro corre por el parque con una pelota roja.",
    "def add(a, b):\n    return a + b",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and then 11, 12, 13.",
]

VOCAB = 384


def _alternating(layers: int) -> list[str]:
    return [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]


def _common_depth(layers: int, **over):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(over)
    return base


# A wider shape whose attention and MLP inputs are 256 wide (llama.cpp's K-quant and IQ4_XS super-blocks
# divide them) and whose down projection's input (288 = 9 x 32) is not: both the K-quants themselves and
# llama.cpp's fallback for them show in one model. Four heads of 64.
WIDE = dict(hidden_size=256, intermediate_size=288)


def tiny_config(model_type: str, layers: int = 2, wide: bool = False, **over):
    """A tiny config of ``model_type`` with ``layers`` decoder blocks (Gemma's alternate sliding-window
    and full attention, as the real models do); ``over`` replaces any setting, given to the constructor
    (e.g. ``rope_scaling``, which transformers 5 turns into its ``rope_parameters`` there). ``wide``: the
    ``WIDE`` shape (hidden 256) instead of hidden 64, whose rows no 256-wide super-block divides."""
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config,
                              Qwen2Config, Qwen3Config)

    head_dim = 64 if wide else 16
    if wide:
        over = {**WIDE, **over}

    def _common(**model_kw):
        if wide and "head_dim" in model_kw:
            model_kw["head_dim"] = head_dim
            if "query_pre_attn_scalar" in model_kw:
                model_kw["query_pre_attn_scalar"] = head_dim
        return _common_depth(layers, **{**model_kw, **over})
    if model_type == "llama":  # kv heads == heads, so AWQ's v_proj -> o_proj mapping is exercised
        return LlamaConfig(**_common(num_key_value_heads=4, tie_word_embeddings=True))
    if model_type == "mistral":
        return MistralConfig(**_common(sliding_window=None, tie_word_embeddings=False))
    if model_type == "qwen2":
        return Qwen2Config(**_common(tie_word_embeddings=True))
    if model_type == "qwen3":
        return Qwen3Config(**_common(head_dim=16, tie_word_embeddings=True))
    if model_type == "phi3":
        return Phi3Config(**_common(tie_word_embeddings=False))
    if model_type == "gemma2":
        return Gemma2Config(**_common(head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                                      layer_types=_alternating(layers)))
    if model_type == "gemma3_text":
        return Gemma3TextConfig(**_common(head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                                          layer_types=_alternating(layers)))
    raise KeyError(model_type)


TINY_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")


# Qwen2's pre-tokenizer split. transformers 5 builds every qwen2 model's tokenizer as its Qwen2Tokenizer (NFC,
# this split, byte-level BPE, <|endoftext|> as a special token) whatever tokenizer.json says, so the tiny
# qwen2 models get a tokenizer of that shape: the ids are then the same under transformers 4.x and 5.x.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def tiny_tokenizer(model_type: str | None = None):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    special = ["<pad>", "<s>", "</s>"]
    if model_type == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        special.append("<|endoftext|>")
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXT * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def bos_tokenizer(model_type: str | None = None):
    """The tiny tokenizer, putting BOS before a text when asked for its special tokens (as Gemma's and
    Llama 3's do)."""
    from tokenizers.processors import TemplateProcessing

    tok = tiny_tokenizer(model_type)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    return tok


def bos_led_nll(model, bos: int, ids: list[int], span: int, windows: int) -> float:
    """Total NLL (nats), by hand, of ``windows`` windows of BOS + ``span`` text tokens of ``ids``, every
    text token scored (the first from BOS alone)."""
    total = 0.0
    with torch.no_grad():
        for w in range(windows):
            window = torch.tensor([bos] + ids[w * span : (w + 1) * span])
            logp = torch.log_softmax(model(window[None]).logits[0].double(), -1)
            total -= sum(float(logp[t - 1, window[t]]) for t in range(1, span + 1))
    return total


def tiny_model(model_type: str, seed: int = 0, layers: int = 2, wide: bool = False):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, layers, wide), attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random norms make scale-folding checks meaningful
                p.copy_(torch.rand_like(p) * 0.5 + (0.75 if p.mean() > 0.5 else 0.1))
            else:
                p.normal_(0, 0.08)
    return model.eval()


def save_tiny(model_type: str, path: Path, seed: int = 0, layers: int = 2, wide: bool = False) -> Path:
    path = Path(path)
    tiny_model(model_type, seed, layers, wide).save_pretrained(path, safe_serialization=True)
    tiny_tokenizer(model_type).save_pretrained(path)
    return path


def calib_text(path: Path, repeats: int = 40) -> Path:
    import random

    rng = random.Random(0)
    lines = [rng.choice(TEXT) for _ in range(len(TEXT) * repeats)]
    Path(path).write_text("\n".join(lines), encoding="utf-8")
    return Path(path)
