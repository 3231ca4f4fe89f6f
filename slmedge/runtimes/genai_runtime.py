"""onnxruntime-genai: an export folder run through ``backends.genai``: genai's own ``Generator``
loop, KV cache and greedy search.

Latency is taken in genai's loop (``append_tokens`` is the prefill; the first
``generate_next_token`` picks the first token, each later one feeds the previous token: one
decode step). Scores come from genai's logits too (``Generator.get_output("logits")`` after a
prefill holds every position's), so perplexity, fidelity and tasks need no second engine;
``info()`` and ``runner_info()`` say so (``logits_from``).
"""

from __future__ import annotations

import time

import numpy as np

from ..backends.genai import INSTALL, GenaiModel, genai_folder, is_genai_folder
from .base import GenerationTiming, Runtime
from .registry import register_runtime

LOGITS_FROM = "onnxruntime-genai (Generator.get_output('logits'))"


@register_runtime("onnxruntime-genai", export_format="onnxruntime-genai", recognizes=is_genai_folder,
                  module="onnxruntime_genai", package="onnxruntime-genai", install=INSTALL,
                  aliases=("genai", "ort-genai", "onnxruntime_genai"), arm64="wheel")
class GenaiRuntime(Runtime):
    def __init__(self, path, threads: int | None = None, n_ctx: int = 2048, gpu: bool = False):
        super().__init__(threads)
        self.genai = GenaiModel(path, self.threads, gpu=gpu)
        self.path = genai_folder(path)
        self.n_ctx = min(int(n_ctx), self.genai.context_length)

    @classmethod
    def open_file(cls, path, threads=None, n_ctx=2048, gpu=False, gpu_layers=-1):
        return cls(path, threads, n_ctx=n_ctx, gpu=gpu)

    @property
    def vocab_size(self) -> int:
        return self.genai.vocab_size

    def info(self) -> dict:
        return {**super().info(), "logits_from": LOGITS_FROM, "generation": "onnxruntime-genai Generator (greedy)"}

    def runner_info(self) -> dict:
        return {"vocab_size": self.vocab_size, "logits_from": LOGITS_FROM}

    def logits(self, ids):
        return self.genai.logits(ids)

    def _prefill(self, ids):
        gen = self.genai.generator(self.n_ctx)
        gen.append_tokens([int(t) for t in ids])
        return np.asarray(gen.get_output("logits"))[0, -1].astype(np.float32), gen

    def _step(self, token, state, position):
        state.append_tokens([int(token)])
        return np.asarray(state.get_output("logits"))[0, -1].astype(np.float32), state

    def timed_generate(self, prompt, n_gen):
        # EOS is masked until n_gen tokens (min_length), so every run decodes the same count.
        total = len(prompt) + int(n_gen)
        gen = self.genai.generator(total, min_length=total)
        t0 = time.perf_counter()
        gen.append_tokens([int(t) for t in prompt])
        gen.generate_next_token()
        t1 = time.perf_counter()
        done = 1
        while done < n_gen and not gen.is_done():
            gen.generate_next_token()
            done += 1
        t2 = time.perf_counter()
        decode_n = done - 1
        return GenerationTiming(len(prompt), done, t1 - t0, len(prompt) / max(t1 - t0, 1e-9),
                                decode_n / max(t2 - t1, 1e-9) if decode_n else 0.0)

    def close(self):
        self.genai.close()
