"""llama.cpp: a GGUF file run through llama-cpp-python (``backends.llamacpp``)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..backends.llamacpp import extra_buffers, load_llama, quiet_native_stderr
from ..errors import ConfigError, CorruptModelError, brief
from .base import Runtime, _token_scores
from .registry import register_runtime


@register_runtime("llama.cpp", export_format="gguf", suffixes=(".gguf",), module="llama_cpp",
                  package="llama-cpp-python", install="pip install llama-cpp-python",
                  aliases=("llamacpp", "llama_cpp"), kv_bytes_per_value=2, arm64="build", holds_context=True)
class LlamaCppRuntime(Runtime):
    def __init__(self, path, threads: int | None = None, n_ctx: int = 2048, n_gpu_layers: int = 0):
        super().__init__(threads)
        self.path = Path(path)
        self.n_ctx = n_ctx
        try:
            with quiet_native_stderr():
                self.llm = load_llama(self.path, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False,
                                      n_threads=self.threads, n_threads_batch=self.threads, n_gpu_layers=n_gpu_layers)
        except ValueError as exc:
            raise CorruptModelError(f"llama.cpp cannot load {self.path}: not a valid GGUF model "
                                    f"({brief(exc, 200)})") from exc

    @classmethod
    def open_file(cls, path, threads=None, n_ctx=2048, gpu=False, gpu_layers=-1):
        return cls(path, threads, n_ctx=n_ctx, n_gpu_layers=gpu_layers if gpu else 0)

    @property
    def vocab_size(self) -> int:
        return int(self.llm.n_vocab())

    def info(self) -> dict:
        # Whether llama.cpp's extra buffer types (AMX, repacked weights) were used: off where AMX is
        # compiled in (backends.llamacpp.AMX_ENV), which changes the kernels, so the speed.
        return {**super().info(), "extra_buffers": extra_buffers()}

    def runner_info(self) -> dict:
        return {"vocab_size": self.vocab_size, "metadata": self.metadata, "n_params": self.n_params}

    @property
    def metadata(self) -> dict:
        """The file's key/values as llama.cpp read them (strings); arrays are left out."""
        return dict(self.llm.metadata)

    @property
    def n_params(self) -> int:
        return int(self.llm._model.n_params())

    def _check_len(self, n: int) -> None:
        if n > self.n_ctx:
            raise ConfigError(f"{n} tokens do not fit llama.cpp's context of {self.n_ctx}")

    def logits(self, ids):
        ids = list(ids)
        self._check_len(len(ids))
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)

    @contextmanager
    def _last_token_outputs_only(self):
        """llama.cpp computes the logits of each batch's last token only (scoring otherwise keeps
        every position's, a full vocabulary head per token); the KV cache is the same."""
        saved = self.llm._logits_all
        self.llm._logits_all = False
        try:
            yield
        finally:
            self.llm._logits_all = saved

    def timed_generate(self, prompt, n_gen):
        # Generation as llama.cpp's own loop runs it: logits of the last token only.
        with self._last_token_outputs_only():
            return super().timed_generate(prompt, n_gen)

    def _last_logits(self, position: int) -> np.ndarray:
        if self.llm._logits_all:
            return np.array(self.llm.scores[position], dtype=np.float32)
        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.vocab_size,)).copy()

    def _prefill(self, ids):
        self._check_len(len(ids))
        self.llm.reset()
        self.llm.eval(ids)
        return self._last_logits(len(ids) - 1), len(ids)

    def _step(self, token, state, position):
        self._check_len(state + 1)
        self.llm.eval([token])
        return self._last_logits(state), state + 1

    def continuation_scores(self, context, continuations):
        # The context is evaluated once; each continuation resumes from its KV cache. Only the
        # continuations' logits are read, so the context runs without its outputs: its KV cache,
        # and so every score, is the same bit for bit.
        context = list(context)
        self._check_len(len(context) + max(len(c) for c in continuations))
        self.llm.reset()
        if len(context) > 1:
            with self._last_token_outputs_only():
                self.llm.eval(context[:-1])
        base = len(context) - 1
        out = []
        for cont in continuations:
            self.llm.n_tokens = base
            seq = [context[-1], *list(cont)[:-1]]
            self.llm.eval(seq)
            logits = np.array(self.llm.scores[base : base + len(seq)], dtype=np.float32)
            out.append(_token_scores(logits, cont))
        return out

    def close(self):
        self.llm.close()
