"""One interface over the three runtimes (torch, onnxruntime, llama.cpp).

Every metric talks to a :class:`Runtime`: ``logits(ids)`` for one sequence from scratch (rolling
perplexity windows, continuation scoring, fidelity), ``timed_generate`` for latency, with a
thread count. Token ids come from one tokenizer chosen per source (see ``open_runtime``), so a
GGUF, an ONNX export and a torch model of the same weights are scored on the same ids.
"""

from __future__ import annotations

import os
import time
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ConfigError, SlmedgeError

RUNTIMES = ("torch", "onnxruntime", "llama.cpp")


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


class Runtime(ABC):
    """A loaded model in one runtime."""

    name: str = ""
    torch_lse = False  # token scores' log-sum-exp in torch (the torch runtime) or numpy

    def __init__(self, threads: int | None = None):
        self.threads = int(threads or os.cpu_count() or 1)

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

    def close(self) -> None:
        pass


def _logsumexp_rows(x: np.ndarray, in_torch: bool = False) -> np.ndarray:
    """Each row's log-sum-exp in float64. The torch runtime computes it in torch (threaded: on
    Gemma 3's 262k vocabulary numpy's takes ~3 s per 512-token window on 2 cores, a third of the
    model's own time); the other runtimes keep numpy's, so a target without torch gives the same
    bits as a local run of the same runtime."""
    if in_torch:
        import torch

        return torch.logsumexp(torch.from_numpy(np.ascontiguousarray(x)).double(), -1).numpy()
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[:, 0]


def _token_scores(logits: np.ndarray, targets, in_torch: bool = False) -> tuple[np.ndarray, bool]:
    """(log softmax(logits)[i, targets[i]] per row in float64, every target the row's argmax)."""
    t = np.asarray(targets)
    picked = logits[np.arange(len(t)), t].astype(np.float64)
    return picked - _logsumexp_rows(logits, in_torch), bool((logits.argmax(-1) == t).all())


def _padded(context, continuations, pad: int):
    seqs = [list(context) + list(c)[:-1] for c in continuations]
    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), pad, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return ids, mask


# --- torch ------------------------------------------------------------------------------------


def torch_tanh_cap(logits, cap: float):
    """Gemma's final logit soft-capping."""
    import torch

    return torch.tanh(logits / cap) * cap


class TorchRuntime(Runtime):
    name = "torch"
    torch_lse = True
    # The shared-prefix path needs a KV cache that can repeat its rows; set False (with one warning)
    # the first time it fails, after which every group runs as whole sequences.
    packing = True

    def __init__(self, model, threads: int | None = None, device: str = "cpu"):
        import torch

        super().__init__(threads)
        torch.set_num_threads(self.threads)
        self.torch = torch
        self.device = device
        self.model = model.to(device).eval()

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def logits(self, ids):
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([list(ids)], device=self.device), use_cache=False)
        return out.logits[0].float().cpu().numpy()

    def continuation_scores(self, context, continuations):
        # The context (but its last token) runs once and its KV cache is shared by the
        # continuations (``_packed_scores`` with one group: no padding in the prefix, so this also
        # holds for sliding-window models).
        torch = self.torch
        ctx = list(context)
        if len(ctx) > 1 and len(continuations) > 0 and self.packing:
            return self._packed_or_alone([(ctx, continuations)])[0]  # failing, it comes back here unpacked
        ids, mask = _padded(ctx, continuations, 0)
        with torch.no_grad():
            logits = self.model(torch.from_numpy(ids).to(self.device),
                                attention_mask=torch.from_numpy(mask).to(self.device), use_cache=False).logits
        logits = logits.float().cpu().numpy()
        n = len(ctx)
        return [_token_scores(logits[i, n - 1 : n - 1 + len(c)], c, self.torch_lse)
                for i, c in enumerate(continuations)]

    def _stop_packing(self, error: Exception) -> None:
        # Caches without batch selection (e.g. some hybrid caches) cannot share a prefix. Said
        # once, not silently: a bug in the fast path also lands here, and the plain path is several
        # times slower on a large vocabulary (every position goes through the head).
        self.packing = False
        warnings.warn(f"{type(self.model).__name__}: shared-prefix scoring failed ({type(error).__name__}: {error}); "
                      "scoring whole sequences from here on (slower)", RuntimeWarning, stacklevel=3)

    def _packed_or_alone(self, groups):
        if self.packing:
            try:
                return self._packed_scores(groups)
            except (AttributeError, NotImplementedError, TypeError) as e:
                self._stop_packing(e)
        return [self.continuation_scores(*g) for g in groups]

    # Tokens per packed forward pass: small models on a CPU run several times faster per token
    # at a few hundred rows than at one short sequence (measured on SmolLM2-135M, 2 threads).
    pack_tokens = 384

    def _attention_window(self) -> int | None:
        """The smallest sliding window of any layer, None when every layer attends to everything."""
        cfg = self.model.config
        window = getattr(cfg, "sliding_window", None)
        sliding = window and getattr(cfg, "use_sliding_window", True)
        if sliding or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
            return int(window or 0)
        return None

    def score_groups(self, groups):
        # Packed rows sit behind their batch's longest prefix, so their slots are further apart than
        # their positions. A sliding window (Gemma 2/3, Mistral) masks by slot: packing is exact
        # only while a whole packed row (prefix slots + continuation) fits in the window, where
        # no key is ever outside it; longer groups run alone (no padding, slots == positions).
        window = self._attention_window()
        out: list = [None] * len(groups)

        def span(i):
            return len(groups[i][0]) - 1 + max(len(c) for c in groups[i][1])

        alone = [i for i, (ctx, conts) in enumerate(groups)
                 if len(ctx) <= 1 or not conts or (window is not None and span(i) > window)]
        for i in alone:
            out[i] = self.continuation_scores(*groups[i])
        skip = set(alone)
        order = sorted((i for i in range(len(groups)) if i not in skip), key=lambda i: -(span(i) + 1))
        batch: list[int] = []
        for i in order:
            trial = batch + [i]
            p = max(len(groups[j][0]) - 1 for j in trial)
            w = max(len(c) for j in trial for c in groups[j][1])
            n = sum(len(groups[j][1]) for j in trial)
            if batch and (len(trial) * p + n * w > self.pack_tokens or (window is not None and p + w > window)):
                for j, r in zip(batch, self._packed_or_alone([groups[j] for j in batch])):
                    out[j] = r
                batch = [i]
            else:
                batch = trial
        if batch:
            for j, r in zip(batch, self._packed_or_alone([groups[j] for j in batch])):
                out[j] = r
        return out

    def _packed_scores(self, groups):
        # Prefixes (each context but its last token) run as one right-padded batch into a KV
        # cache; its rows are repeated per continuation; the continuations then run as one
        # right-padded batch with explicit positions, their mask hiding the prefixes' pads.
        torch = self.torch
        from transformers import DynamicCache

        base = self.model.get_decoder()  # not base_model_prefix: Gemma 3's names a module it does not have
        plen = [len(ctx) - 1 for ctx, _ in groups]
        p = max(plen)
        rows = [(g, c) for g, (_, conts) in enumerate(groups) for c in conts]
        seqs = [[groups[g][0][-1], *list(c)[:-1]] for g, c in rows]
        w = max(len(x) for x in seqs)
        pre = torch.zeros((len(groups), p), dtype=torch.long)
        pre_mask = torch.zeros((len(groups), p), dtype=torch.long)
        for g, (ctx, _) in enumerate(groups):
            pre[g, : plen[g]] = torch.tensor(ctx[:-1])
            pre_mask[g, : plen[g]] = 1
        ids = torch.zeros((len(rows), w), dtype=torch.long)
        mask = torch.zeros((len(rows), p + w), dtype=torch.long)
        pos = torch.zeros((len(rows), w), dtype=torch.long)
        for r, ((g, _), x) in enumerate(zip(rows, seqs)):
            ids[r, : len(x)] = torch.tensor(x)
            mask[r, : plen[g]] = 1
            mask[r, p : p + len(x)] = 1
            pos[r] = torch.arange(plen[g], plen[g] + w)
        dev = self.device
        with torch.no_grad():
            cache = DynamicCache(config=self.model.config)
            base(input_ids=pre.to(dev), attention_mask=pre_mask.to(dev), past_key_values=cache, use_cache=True)
            cache.batch_select_indices(torch.tensor([g for g, _ in rows], device=dev))
            hidden = base(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                          past_key_values=cache, use_cache=True).last_hidden_state
            picked = torch.cat([hidden[r, : len(c)] for r, (_, c) in enumerate(rows)])
            logits = self._head(picked).float().cpu().numpy()
        out: list[list] = [[] for _ in groups]
        at = 0
        for g, c in rows:
            out[g].append(_token_scores(logits[at : at + len(c)], c, self.torch_lse))
            at += len(c)
        return out

    def _head(self, hidden):
        logits = self.model.lm_head(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return torch_tanh_cap(logits, cap) if cap else logits

    def hidden_states(self, ids):
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([list(ids)], device=self.device), use_cache=False,
                             output_hidden_states=True)
        return out.hidden_states[-1][0].float().cpu().numpy()

    def _prefill(self, ids):
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([ids], device=self.device), use_cache=True)
        return out.logits[0, -1].float().cpu().numpy(), out.past_key_values

    def _step(self, token, state, position):
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([[token]], device=self.device), past_key_values=state, use_cache=True)
        return out.logits[0, -1].float().cpu().numpy(), out.past_key_values


# --- onnxruntime ------------------------------------------------------------------------------


class OnnxRuntime(Runtime):
    name = "onnxruntime"

    def __init__(self, path, threads: int | None = None, providers: list[str] | None = None):
        from .ort import OrtDecoder

        super().__init__(threads)
        self.decoder = OrtDecoder(path, n_threads=self.threads, providers=providers)
        self.path = self.decoder.path

    @property
    def vocab_size(self) -> int:
        shape = self.decoder.session.get_outputs()[0].shape
        return int(shape[-1]) if isinstance(shape[-1], int) else -1

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


# --- llama.cpp --------------------------------------------------------------------------------


class LlamaCppRuntime(Runtime):
    name = "llama.cpp"

    def __init__(self, path, threads: int | None = None, n_ctx: int = 2048, n_gpu_layers: int = 0):
        from .native import quiet_native_stderr, require_llama_cpp

        super().__init__(threads)
        llama_cpp = require_llama_cpp()
        self.path = Path(path)
        self.n_ctx = n_ctx
        try:
            with quiet_native_stderr():
                self.llm = llama_cpp.Llama(model_path=str(self.path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True,
                                           verbose=False, n_threads=self.threads, n_threads_batch=self.threads,
                                           n_gpu_layers=n_gpu_layers)
        except ValueError as exc:
            raise CorruptModelError(f"llama.cpp cannot load {self.path}: not a valid GGUF model "
                                    f"({str(exc).splitlines()[0][:200]})") from exc

    @property
    def vocab_size(self) -> int:
        return int(self.llm.n_vocab())

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

    def timed_generate(self, prompt, n_gen):
        # Generation as llama.cpp's own loop runs it: logits of the last token only (scoring
        # keeps every position's logits, which costs the prefill a full head per token).
        saved = self.llm._logits_all
        self.llm._logits_all = False
        try:
            return super().timed_generate(prompt, n_gen)
        finally:
            self.llm._logits_all = saved

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
        # The context is evaluated once; each continuation resumes from its KV cache.
        context = list(context)
        self._check_len(len(context) + max(len(c) for c in continuations))
        self.llm.reset()
        self.llm.eval(context[:-1]) if len(context) > 1 else None
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


class CorruptModelError(SlmedgeError):
    """A model file its runtime cannot load."""


def gguf_metadata(path) -> dict:
    """A GGUF file's key/values through llama.cpp's reader (vocabulary only: fast, unlike a full
    Python parse of the tokenizer arrays)."""
    from .native import vocab_only

    try:
        with vocab_only(path) as llm:
            return dict(llm.metadata)
    except ValueError as exc:
        raise CorruptModelError(f"llama.cpp cannot read {path}: not a valid GGUF model") from exc


def runtime_for_path(path) -> str:
    """The runtime a file implies: .gguf -> llama.cpp, .onnx or an ONNX folder -> onnxruntime, else torch."""
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        return "llama.cpp"
    if p.suffix.lower() == ".onnx" or (p.is_dir() and (p / "model.onnx").is_file()):
        return "onnxruntime"
    return "torch"


def check_runtime_name(name: str) -> str:
    key = {"llamacpp": "llama.cpp", "llama_cpp": "llama.cpp", "ort": "onnxruntime", "onnx": "onnxruntime",
           "pytorch": "torch"}.get(name.lower(), name.lower())
    if key not in RUNTIMES:
        raise ConfigError(f"unknown runtime '{name}'; choose {', '.join(RUNTIMES)}")
    return key
