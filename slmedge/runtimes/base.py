"""The interface every runtime implements (torch, onnxruntime, llama.cpp, a runner on a target).

Every metric talks to a :class:`Runtime`: ``logits(ids)`` for one sequence from scratch (rolling
perplexity windows, continuation scoring, fidelity), ``timed_generate`` for latency, with a
thread count. Token ids come from one tokenizer chosen per source (``slmedge.evaluate.subject``),
so a GGUF, an ONNX export and a torch model of the same weights are scored on the same ids.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np



@dataclass
class GenerationTiming:
    prompt_tokens: int
    generated: int
    ttft_s: float  # time to first token: the prefill plus picking the first token
    prefill_tps: float
    decode_tps: float


@dataclass
class RuntimeInfo:
    runtime: str
    path: str
    threads: int
    versions: dict = field(default_factory=dict)


# The calls through which a runtime's native code runs: each is marked (``slmedge.procs.native``) with
# the runtime's name and file in every subclass, so a crash inside one is reported naming both.
NATIVE_CALLS = ("logits", "_prefill", "_step", "continuation_scores", "score_groups", "hidden_states",
                "sequence_scores", "sequence_outputs", "timed_generate", "close")


def _where(runtime) -> tuple[str, object]:
    """(name, file) of the runtime a marked call runs in: read with defaults, since the base class's
    loops are also borrowed by objects that only look like a runtime (tests' fixed-logit stand-ins)."""
    return getattr(runtime, "name", "") or type(runtime).__name__, getattr(runtime, "path", None)


def _marked(fn):
    """``fn`` (a runtime method; a generator's every step) inside ``native(runtime name, its file)``."""
    import functools
    import inspect

    from ..procs import native

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def steps(self, *args, **kwargs):
            it = fn(self, *args, **kwargs)
            while True:
                with native(*_where(self)):
                    try:
                        item = next(it)
                    except StopIteration:
                        return
                yield item

        return steps

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        with native(*_where(self)):
            return fn(self, *args, **kwargs)

    return call


class Runtime(ABC):
    """A loaded model in one runtime."""

    name: str = ""  # set by @register_runtime
    path = None  # the model file or folder it runs (None: a model handed over in memory)
    torch_lse = False  # token scores' log-sum-exp in torch (the torch runtime) or numpy
    # Where it runs, when not in this process on the CPU: set by the transport that opened it.
    target: str = ""
    emulated: bool = False
    transport = None  # the Transport whose runner serves it (remote runtimes), else None
    target_versions: dict | None = None  # what the target's runner reported
    remote_path: str | None = None  # the model file's path on the target

    def __init__(self, threads: int | None = None):
        self.threads = int(threads or os.cpu_count() or 1)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in NATIVE_CALLS:
            fn = cls.__dict__.get(name)
            if callable(fn) and not getattr(fn, "_native_marked", False):
                marked = _marked(fn)
                marked._native_marked = True
                setattr(cls, name, marked)

    @classmethod
    def open_file(cls, path, threads: int | None = None, n_ctx: int = 2048, gpu: bool = False,
                  gpu_layers: int = -1) -> "Runtime":
        """A model file opened in this runtime here (runtimes that run files override it)."""
        raise NotImplementedError(f"{cls.name} runs model sources, not files")

    def placed(self, transport, versions: dict | None) -> "Runtime":
        """Mark this runtime as served by ``transport`` (its target and the versions found there)."""
        self.transport = transport
        self.target = transport.profile.name
        self.emulated = transport.emulated
        self.target_versions = versions
        return self

    @abstractmethod
    def logits(self, ids: list[int]) -> np.ndarray:
        """(T, V) float32 logits of one sequence, no cache carried over from earlier calls."""

    @abstractmethod
    def _prefill(self, ids: list[int]):
        """Start a sequence; returns (last logits (V,), state)."""

    @abstractmethod
    def _step(self, token: int, state, position: int):
        """Feed one token; returns (logits (V,), state)."""

    def continuation_logprobs(self, context: list[int], continuations: list[list[int]]) -> list[np.ndarray]:
        """Log-probabilities of each continuation's tokens after ``context`` (one array per continuation)."""
        return [lp for lp, _ in self.continuation_scores(context, continuations)]

    def continuation_scores(self, context: list[int], continuations: list[list[int]]) -> list[tuple[np.ndarray, bool]]:
        """Per continuation: its tokens' log-probabilities and whether greedy decoding would produce it."""
        out = []
        for cont in continuations:
            seq = list(context) + list(cont)
            logits = self.logits(seq[:-1])
            out.append(_token_scores(logits[len(context) - 1 :], cont, self.torch_lse))
        return out

    def score_groups(self, groups: list[tuple[list[int], list[list[int]]]]) -> list[list[tuple[np.ndarray, bool]]]:
        """``continuation_scores`` for many (context, continuations) groups at once; runtimes that
        can batch across contexts (torch) override it."""
        return [self.continuation_scores(ctx, conts) for ctx, conts in groups]

    def hidden_states(self, ids: list[int]) -> np.ndarray | None:
        """(T, H) final hidden states where the runtime exposes them (torch), else None."""
        return None

    def sequence_scores(self, seqs: list[list[int]]) -> Iterator[tuple[np.ndarray, bool]]:
        """Per sequence, in order, ``continuation_scores(seq[:1], [seq[1:]])``: every token after the
        first scored (perplexity windows). Runtimes that run many sequences in one pass (torch)
        override it; the results are the same."""
        for seq in seqs:
            yield self.continuation_scores(list(seq[:1]), [list(seq[1:])])[0]

    def sequence_outputs(self, seqs: list[list[int]], hidden: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """Per sequence, in order, (``logits(seq)``, ``hidden_states(seq)`` if ``hidden`` else None), one
        sequence at a time (fidelity windows). Runtimes that run many sequences in one pass (torch)
        override it; the results are the same."""
        for seq in seqs:
            yield self.logits(seq), (self.hidden_states(seq) if hidden else None)

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    def timed_generate(self, prompt: list[int], n_gen: int) -> GenerationTiming:
        """Greedy decoding of ``n_gen`` tokens after ``prompt``, timed (llama-bench's pp/tg split)."""
        t0 = time.perf_counter()
        last, state = self._prefill(list(prompt))
        token = int(np.argmax(last))
        t1 = time.perf_counter()
        for i in range(n_gen - 1):
            last, state = self._step(token, state, len(prompt) + i)
            token = int(np.argmax(last))
        t2 = time.perf_counter()
        decode_n = max(n_gen - 1, 0)
        return GenerationTiming(len(prompt), n_gen, t1 - t0, len(prompt) / max(t1 - t0, 1e-9),
                                decode_n / max(t2 - t1, 1e-9) if decode_n else 0.0)

    def info(self) -> dict:
        return {"runtime": self.name, "threads": self.threads}

    def runner_info(self) -> dict:
        """What a target's runner reports about the opened model (runtimes add their own facts)."""
        return {"vocab_size": self.vocab_size}

    def static_kv_cache(self) -> dict | None:
        """A KV cache the opened model holds whole, whatever the context (``{"tokens", "bytes"}``: ExecuTorch's
        static cache); None where it grows with the context (estimated from the config at the context)."""
        return None

    def close(self) -> None:
        pass


def _logsumexp_rows(x: np.ndarray, in_torch: bool = False) -> np.ndarray:
    """Each row's log-sum-exp in float64. The torch runtime computes it in torch (threaded: on
    Gemma 3's 262k vocabulary numpy's takes ~3 s per 512-token window on 2 cores, a third of the
    model's own time); the other runtimes keep numpy's, so a target without torch gives the same
    bits as a local run of the same runtime."""
    if in_torch:
        import torch

        # In blocks of rows, so that the float64 copy is a block's (a 512 x 151,936 window's would be
        # 0.6 GB, twice over); each row's value is the same whichever rows share its block, as long as
        # blocks have many more rows than threads (torch then splits rows among threads, not a row's
        # sum): blocks of ``step`` to 2 x ``step`` - 1 rows, the last one taking the remainder.
        x = torch.from_numpy(np.ascontiguousarray(x))
        step = max(64, 4 * torch.get_num_threads())
        starts = [0, *range(step, len(x) - step + 1, step), len(x)]
        return torch.cat([torch.logsumexp(x[a:b].double(), -1) for a, b in zip(starts, starts[1:])]).numpy()
    return _lse_numpy(x)


def _lse_numpy(x: np.ndarray) -> np.ndarray:
    """Each row's log-sum-exp: the exponentials in float32 (every one in (0, 1], relative error ~1e-7),
    summed in float64. A float64 copy of the whole row block made the exponentials ~30x slower (~1.2 s per
    512 x 49,152 window on this CPU against 0.04 s); the result is within 4e-8 of float64's (5e-9 on
    unit-scale logits)."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        x = x.astype(np.float32)
    m = x.max(-1, keepdims=True)
    e = np.subtract(x, m)
    np.exp(e, out=e)
    return m[:, 0].astype(np.float64) + np.log(e.sum(-1, dtype=np.float64))


# The base class's own calls (the scoring and decoding loops every runtime inherits) are marked too:
# a generation's steps then run inside its mark, and each step's own mark costs a list push and pop.
for _name in NATIVE_CALLS:
    _fn = Runtime.__dict__.get(_name)
    if callable(_fn) and not getattr(_fn, "__isabstractmethod__", False):
        setattr(Runtime, _name, _marked(_fn))
        getattr(Runtime, _name)._native_marked = True
del _name, _fn


def _token_scores(logits: np.ndarray, targets, in_torch: bool = False) -> tuple[np.ndarray, bool]:
    """(log softmax(logits)[i, targets[i]] per row in float64, every target the row's argmax)."""
    t = np.asarray(targets)
    picked = logits[np.arange(len(t)), t].astype(np.float64)
    return picked - _logsumexp_rows(logits, in_torch), bool((logits.argmax(-1) == t).all())
