"""ExecuTorch: run a ``.pte`` program slmedge exported (``export.executorch``) in ExecuTorch's Python
bindings (``executorch.extension.pybindings.portable_lib``) on token ids.

The program's one method, ``forward(input_ids (1, T), cache_position (T,))``, returns (1, T, vocab)
logits and keeps its KV cache (a static cache of the export's context length) inside the program: a
call at ``cache_position`` 0 starts a new sequence, a call at the next position continues it
(transformers' ``TorchExportableModuleForDecoderOnlyLM`` layout, the one ExecuTorch's LLM runner reads).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

import numpy as np

from ..errors import ConfigError, CorruptModelError, RuntimeNotInstalledError, SlmedgeError, brief
from ..procs import native

PROGRAM = "model.pte"  # the program file of an export folder
INSTALL = "pip install 'slmedge[executorch]'"


class ExecuTorchNotInstalledError(RuntimeNotInstalledError, ConfigError):
    """The executorch extra is not installed (a setting of this machine: exit 2)."""


def require_executorch():
    """ExecuTorch's runtime bindings, or the one line that says how to install them."""
    from ..quiet import quiet_torch_loggers

    quiet_torch_loggers()  # torchao, imported with executorch, makes torch log at import
    try:
        from executorch.extension.pybindings import portable_lib
    except ImportError as exc:
        raise ExecuTorchNotInstalledError(f"ExecuTorch is not installed; install it with: {INSTALL} "
                                          "(x86-64 Linux and macOS wheels only)") from exc
    return portable_lib


def program_file(path) -> Path:
    """A ``.pte`` file, or the ``model.pte`` of an export folder."""
    p = Path(path)
    if p.is_dir():
        p = p / PROGRAM
    if not p.is_file():
        raise CorruptModelError(f"{p} does not exist")
    return p


def is_executorch_folder(path: Path) -> bool:
    return Path(path).is_dir() and (Path(path) / PROGRAM).is_file()


def cache_slots(context: int) -> int:
    """The positions each layer's static KV cache holds in a program of ``context`` positions: one more (a feed
    of ``context`` tokens keeps the exported sequence dimension below the cache's length)."""
    return context + 1


def static_kv_cache(folder, context: int) -> dict | None:
    """The KV cache inside a program of ``context`` positions whose model's ``config.json`` is in ``folder``:
    keys and values of every layer at ``cache_slots(context)`` positions in fp32, allocated whole when the
    program loads (transformers' export wrapper gives a sliding-window layer a full-length cache too).
    ``{"tokens": positions, "bytes": bytes}``; None without a readable config."""
    from transformers import AutoConfig
    from transformers.configuration_utils import get_head_shapes

    try:
        config = AutoConfig.from_pretrained(str(folder)).get_text_config()
        kv_heads, head_dim = get_head_shapes(config)  # an int each, or one per layer
        layers = int(config.num_hidden_layers)
    except (OSError, ValueError, AttributeError, TypeError, ZeroDivisionError):
        return None
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    head_dim = head_dim if isinstance(head_dim, list) else [head_dim] * layers
    slots = cache_slots(context)
    return {"tokens": slots, "bytes": sum(2 * h * d * slots * 4 for h, d in zip(kv_heads, head_dim))}


@contextlib.contextmanager
def _native_log_off():
    """ExecuTorch's C++ log lines (cpuinfo's probes, a bad file's reasons) written to fd 2 while a program
    loads, kept out of slmedge's output (the reason is in the error slmedge raises); ``--debug`` keeps them."""
    from ..quiet import debugging

    if debugging():
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # the bindings also write through Python's sys.stderr
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class EtDecoder:
    """A loaded program; ``run(ids, start)`` feeds ids at positions start.. through its KV cache."""

    def __init__(self, path):
        lib = require_executorch()
        self.path = program_file(path)
        try:
            with native("ExecuTorch", self.path), _native_log_off():
                self.module = lib._load_for_executorch(str(self.path))
                meta = self.module.method_meta("forward")
        except Exception as exc:  # noqa: BLE001 - the bindings raise RuntimeError/ValueError for a bad program
            raise CorruptModelError(f"ExecuTorch cannot load {self.path}: {brief(exc, 200)}") from exc
        inputs = [meta.input_tensor_meta(i) for i in range(meta.num_inputs())]
        if meta.num_inputs() != 2 or meta.num_outputs() != 1 or len(inputs[0].sizes()) != 2:
            raise CorruptModelError(f"{self.path} is not a decoder program slmedge exported (forward(input_ids, "
                                    "cache_position) -> logits)")
        self.max_tokens = int(inputs[0].sizes()[1])  # the longest feed: the export's context
        self.vocab_size = int(meta.output_tensor_meta(0).sizes()[-1])

    def run(self, ids, start: int = 0) -> np.ndarray:
        """(T, V) float32 logits of ``ids`` fed at positions ``start``..``start + T - 1``."""
        import torch

        ids = [int(i) for i in ids]
        if start + len(ids) > self.max_tokens:
            raise ConfigError(f"{start + len(ids)} positions are past this ExecuTorch program's context of "
                              f"{self.max_tokens} positions (the model's, fixed when it was exported)")
        try:
            with native("ExecuTorch", self.path):
                out = self.module.forward((torch.tensor([ids], dtype=torch.long),
                                           torch.arange(start, start + len(ids), dtype=torch.long)))
        except SlmedgeError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise CorruptModelError(f"ExecuTorch failed running {self.path}: {brief(exc, 200)}") from exc
        return out[0][0].float().numpy()

    def logits(self, ids) -> np.ndarray:
        return self.run(ids, 0)

    def incremental_logits(self, ids, split: int) -> np.ndarray:
        """Prefill ``ids[:split]``, then the rest one token at a time through the program's KV cache."""
        ids = list(ids)
        rows = [self.run(ids[:split], 0)]
        rows += [self.run([ids[i]], i) for i in range(split, len(ids))]
        return np.concatenate(rows, axis=0)

    def greedy(self, ids, n: int) -> list[int]:
        """``n`` tokens after ``ids``, greedy, through the KV cache."""
        ids = list(ids)
        last = self.run(ids, 0)[-1]
        out = []
        for i in range(n):
            tok = int(np.argmax(last))
            out.append(tok)
            if i + 1 < n:
                last = self.run([tok], len(ids) + i)[-1]
        return out
