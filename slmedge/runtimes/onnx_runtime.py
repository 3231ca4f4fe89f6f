"""onnxruntime: an ONNX export (the traced decoder with its KV cache) run through ``backends.ort``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..backends.ort import OrtDecoder
from .base import Runtime, _token_scores
from .registry import register_runtime


def _is_onnx_export(path: Path) -> bool:
    return path.is_dir() and (path / "model.onnx").is_file()


@register_runtime("onnxruntime", export_format="onnx", suffixes=(".onnx",), recognizes=_is_onnx_export,
                  module="onnxruntime", package="onnxruntime", install="pip install onnxruntime",
                  aliases=("ort", "onnx"), arm64="wheel")
class OnnxRuntime(Runtime):
    def __init__(self, path, threads: int | None = None, providers: list[str] | None = None):
        super().__init__(threads)
        self.decoder = OrtDecoder(path, n_threads=self.threads, providers=providers)
        self.path = self.decoder.path

    @classmethod
    def open_file(cls, path, threads=None, n_ctx=2048, gpu=False, gpu_layers=-1):
        return cls(path, threads, providers=["CUDAExecutionProvider", "CPUExecutionProvider"] if gpu else None)

    @property
    def vocab_size(self) -> int:
        shape = self.decoder.session.get_outputs()[0].shape
        return int(shape[-1]) if isinstance(shape[-1], int) else -1

    def runner_info(self) -> dict:
        return {"vocab_size": self.vocab_size, "providers": self.decoder.session.get_providers()}

    def logits(self, ids):
        return self.decoder.logits(list(ids))

    pack_tokens = 384  # tokens (rows x width) per padded batch in score_groups

    def continuation_scores(self, context, continuations):
        return self.score_groups([(context, continuations)])[0]

    def score_groups(self, groups):
        # Whole sequences of many groups, longest first, as right-padded batches.
        rows = [(g, k) for g, (_, conts) in enumerate(groups) for k in range(len(conts))]
        rows.sort(key=lambda r: -(len(groups[r[0]][0]) + len(groups[r[0]][1][r[1]])))
        out: list[list] = [[None] * len(conts) for _, conts in groups]
        at = 0
        while at < len(rows):
            width = len(groups[rows[at][0]][0]) + len(groups[rows[at][0]][1][rows[at][1]]) - 1
            n = max(1, min(len(rows) - at, self.pack_tokens // max(width, 1)))
            chunk = rows[at : at + n]
            seqs = [list(groups[g][0]) + list(groups[g][1][k])[:-1] for g, k in chunk]
            ids = np.zeros((len(seqs), width), dtype=np.int64)
            mask = np.zeros_like(ids)
            for i, x in enumerate(seqs):
                ids[i, : len(x)] = x
                mask[i, : len(x)] = 1
            logits, _ = self.decoder.run(ids, attention_mask=mask)
            for i, (g, k) in enumerate(chunk):
                ctx, cont = groups[g][0], groups[g][1][k]
                out[g][k] = _token_scores(logits[i, len(ctx) - 1 : len(ctx) - 1 + len(cont)], cont)
            at += n
        return out

    def _prefill(self, ids):
        out, past = self.decoder.run(np.asarray([ids]))
        return out[0, -1], past

    def _step(self, token, state, position):
        out, past = self.decoder.run(np.asarray([[token]]), state, past_len=position)
        return out[0, -1], past
