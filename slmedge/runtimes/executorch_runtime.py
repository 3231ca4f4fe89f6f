"""ExecuTorch: a ``.pte`` program (``slmedge export --format executorch``) run through
``backends.executorch`` in ExecuTorch's Python bindings; prefill and decode go through the program's
own KV cache. There is no aarch64 Linux wheel of ExecuTorch: the emulated arm64 target has no
runtime for it (``arm64=""``)."""

from __future__ import annotations

from ..backends.executorch import INSTALL, EtDecoder, is_executorch_folder, static_kv_cache
from .base import Runtime
from .registry import register_runtime


@register_runtime("executorch", export_format="executorch", suffixes=(".pte",), recognizes=is_executorch_folder,
                  module="executorch.extension.pybindings.portable_lib", package="executorch", install=INSTALL,
                  aliases=("et", "pte"), arm64="")
class ExecuTorchRuntime(Runtime):
    def __init__(self, path, threads: int | None = None):
        super().__init__(threads)
        self.decoder = EtDecoder(path)
        self.path = self.decoder.path

    @classmethod
    def open_file(cls, path, threads=None, n_ctx=2048, gpu=False, gpu_layers=-1):
        return cls(path, threads)

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    def runner_info(self) -> dict:
        return {"vocab_size": self.vocab_size, "context": self.decoder.max_tokens, "backend": "XNNPACK"}

    def static_kv_cache(self) -> dict | None:
        """The program's KV cache: every layer at its positions (read from the program), the config beside it."""
        return static_kv_cache(self.path.parent, self.decoder.max_tokens)

    def logits(self, ids):
        return self.decoder.logits(list(ids))

    def _prefill(self, ids):
        return self.decoder.run(list(ids), 0)[-1], len(ids)

    def _step(self, token, state, position):
        return self.decoder.run([token], position)[-1], position + 1
