"""onnxruntime: run a decoder exported with KV cache (the layout slmedge, optimum and onnxruntime-genai's builder write) on token ids.

The session's own input metadata says what it needs: ``input_ids``, ``attention_mask``,
``position_ids`` when present (Gemma exports have none), and ``past_key_values.N.key/value``
whose fixed dimensions (KV heads, head size) and element type are read from the graph, so the
same runner serves fp32, fp16 and quantized files of any architecture.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from ..errors import SlmedgeError, brief
from ..procs import native

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_NP_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
             "tensor(int32)": np.int32}


class OnnxModelError(SlmedgeError):
    """An ONNX file that is not a decoder slmedge can run (no KV cache, unknown inputs)."""


def require_onnxruntime():
    try:
        import onnxruntime
    except ImportError as exc:
        from ..errors import RuntimeNotInstalledError

        raise RuntimeNotInstalledError("onnxruntime is not installed; install it with: pip install onnxruntime") from exc
    return onnxruntime


def model_file(path) -> Path:
    """A ``.onnx`` file, or the ``model.onnx`` (else the only .onnx) of an export directory."""
    p = Path(path)
    if p.is_dir():
        if (p / "model.onnx").is_file():
            return p / "model.onnx"
        found = sorted(p.glob("*.onnx"))
        if len(found) != 1:
            raise OnnxModelError(f"{p} holds {len(found)} .onnx files; name the one to use")
        return found[0]
    if not p.is_file():
        raise OnnxModelError(f"{p} does not exist")
    return p


class OrtDecoder:
    """An InferenceSession over a decoder with KV cache; ``logits(ids)`` and incremental ``step``."""

    def __init__(self, path, n_threads: int | None = None, providers: list[str] | None = None):
        ort = require_onnxruntime()
        self.path = model_file(path)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(n_threads or os.cpu_count() or 1)
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        try:
            with native("onnxruntime", self.path):
                self.session = ort.InferenceSession(str(self.path), opts, providers=providers or ["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
            raise OnnxModelError(f"onnxruntime cannot load {self.path}: {brief(exc)}") from exc
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]
        if "input_ids" not in self.inputs or "logits" not in self.output_names:
            raise OnnxModelError(f"{self.path} is not a causal LM decoder (needs input_ids in, logits out)")
        self.past: list[tuple[str, tuple, type]] = []
        layers = set()
        for name, info in self.inputs.items():
            m = _PAST.match(name)
            if m:
                layers.add(int(m.group(1)))
                self.past.append((name, tuple(info.shape), _NP_TYPES.get(info.type, np.float32)))
            elif name not in ("input_ids", "attention_mask", "position_ids"):
                raise OnnxModelError(f"{self.path} has an input slmedge does not know how to feed: {name}")
        if not self.past:
            raise OnnxModelError(f"{self.path} has no KV cache (past_key_values.N.key/value inputs); export it with "
                                 "slmedge export --format onnx (task text-generation-with-past)")
        self.num_layers = len(layers)
        self.present_names = [o for o in self.output_names if o.startswith("present.")]

    def _empty_past(self, batch: int) -> dict:
        feeds = {}
        for name, shape, dtype in self.past:
            dims = [batch if i == 0 else (0 if not isinstance(d, int) else d) for i, d in enumerate(shape)]
            feeds[name] = np.zeros(dims, dtype=dtype)
        return feeds

    def run(self, ids: np.ndarray, past: dict | None = None, past_len: int = 0, attention_mask=None):
        """Feed (batch, T) ids after ``past_len`` cached positions; returns (logits, present feeds).

        ``attention_mask`` (batch, past_len + T) marks right padding in a batch of unequal rows."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim == 1:
            ids = ids[None]
        batch, t = ids.shape
        feeds = {"input_ids": ids}
        if "attention_mask" in self.inputs:
            feeds["attention_mask"] = (np.ones((batch, past_len + t), dtype=np.int64) if attention_mask is None
                                       else np.asarray(attention_mask, dtype=np.int64))
        if "position_ids" in self.inputs:
            feeds["position_ids"] = np.broadcast_to(np.arange(past_len, past_len + t, dtype=np.int64), (batch, t)).copy()
        if past is None:
            past = self._empty_past(batch)
        else:  # some exports return present.* in another float type than past_key_values.* take
            past = {name: past[name].astype(dtype, copy=False) for name, _, dtype in self.past}
        feeds.update(past)
        with native("onnxruntime", self.path):
            outs = self.session.run(None, feeds)
        by_name = dict(zip(self.output_names, outs))
        present = {name.replace("present.", "past_key_values.", 1): by_name[name] for name in self.present_names}
        return by_name["logits"], present

    def logits(self, ids) -> np.ndarray:
        """(T, V) float32 logits of one sequence, in one prefill."""
        out, _ = self.run(np.asarray(ids)[None])
        return out[0].astype(np.float32)

    def incremental_logits(self, ids, split: int) -> np.ndarray:
        """Prefill ``ids[:split]``, then feed the rest one token at a time through the KV cache."""
        ids = list(ids)
        first, past = self.run(np.asarray(ids[:split])[None])
        rows = [first[0]]
        for i in range(split, len(ids)):
            out, past = self.run(np.asarray([[ids[i]]]), past, past_len=i)
            rows.append(out[0])
        return np.concatenate(rows, axis=0).astype(np.float32)
