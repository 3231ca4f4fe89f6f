"""onnxruntime-genai: open an export folder (``genai_config.json`` beside the ONNX decoder) and
run genai's own ``Generator`` on token ids: per-position logits of a prefill, greedy search.

After ``append_tokens`` over a sequence, ``Generator.get_output("logits")`` holds every
position's logits (``(1, T, V)``), so a sequence is scored by genai itself. genai runs the file on
the onnxruntime installed beside it (its wheel requires that package). Shipped to targets: no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import ConfigError, CorruptModelError, RuntimeNotInstalledError, brief
from ..procs import native

GENAI_CONFIG = "genai_config.json"
INSTALL = "pip install 'slmedge[genai]'"


def require_genai():
    try:
        import onnxruntime_genai
    except ImportError as exc:
        raise RuntimeNotInstalledError(f"onnxruntime-genai is not installed; install it with: {INSTALL}") from exc
    return onnxruntime_genai


def genai_folder(path) -> Path:
    """The folder genai opens: ``path`` itself, or the folder of its genai_config.json."""
    p = Path(path)
    return p if p.is_dir() else p.parent


def is_genai_folder(path) -> bool:
    """A folder (or its genai_config.json) that onnxruntime-genai can open."""
    p = Path(path)
    return (p.is_dir() and (p / GENAI_CONFIG).is_file()) or (p.is_file() and p.name == GENAI_CONFIG)


class GenaiModel:
    """``og.Model`` of a folder with the caller's thread count (whatever the file says: runtimes are
    compared at equal threads), on the CPU unless ``gpu``."""

    def __init__(self, path, threads: int, gpu: bool = False):
        self.og = og = require_genai()
        self.path = genai_folder(path)
        cfg_file = self.path / GENAI_CONFIG
        try:
            self.config = json.loads(cfg_file.read_text(encoding="utf-8"))
            model = self.config["model"]
            self.context_length = int(model["context_length"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CorruptModelError(f"{cfg_file} is not an onnxruntime-genai config ({exc})") from exc
        eos = model.get("eos_token_id")
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.vocab_size = int(model.get("vocab_size") or -1)
        config = og.Config(str(self.path))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": int(threads), "inter_op_num_threads": 1}}}}))
        config.clear_providers()
        if gpu:
            config.append_provider("cuda")
        try:
            with native("onnxruntime-genai", self.path):
                self.model = og.Model(config)
        except Exception as exc:  # noqa: BLE001 - genai raises RuntimeError with the reason
            raise CorruptModelError(f"onnxruntime-genai cannot load {self.path}: "
                                    f"{brief(exc)}") from exc

    def check_len(self, n: int) -> None:
        if n > self.context_length:
            raise ConfigError(f"{n} tokens do not fit onnxruntime-genai's context of {self.context_length} "
                              f"({GENAI_CONFIG}'s context_length)")

    def generator(self, max_length: int, min_length: int = 0):
        """A greedy Generator for sequences up to ``max_length`` (EOS masked before ``min_length``)."""
        self.check_len(max_length)
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=int(max_length), min_length=int(min_length), do_sample=False,
                                  num_beams=1)
        return self.og.Generator(self.model, params)

    def logits(self, ids) -> np.ndarray:
        """(T, V) float32 logits of one sequence, in one prefill."""
        ids = [int(t) for t in ids]
        with native("onnxruntime-genai", self.path):
            gen = self.generator(len(ids) + 1)
            gen.append_tokens(ids)
            return np.asarray(gen.get_output("logits")).reshape(len(ids), -1).astype(np.float32)

    def greedy(self, prompt, n_new: int) -> list[int]:
        """Up to ``n_new`` tokens after ``prompt`` from genai's greedy search (it stops at EOS)."""
        prompt = [int(t) for t in prompt]
        with native("onnxruntime-genai", self.path):
            gen = self.generator(len(prompt) + n_new)
            gen.append_tokens(prompt)
            while not gen.is_done():
                gen.generate_next_token()
            return [int(t) for t in gen.get_sequence(0)][len(prompt):]

    def encode(self, text: str) -> list[int]:
        """genai's own tokenizer (tokenizer.json in the folder) on ``text``."""
        return [int(t) for t in self.og.Tokenizer(self.model).encode(text)]

    def close(self) -> None:
        self.model = None
