"""An evaluation's settings against its model and its target, checked before the model opens.

- Lengths: the perplexity window (``seqlen``), the context (``context``: the KV-cache figure, the
  tasks' longest input, llama.cpp's n_ctx) and the latency run (``pp + tg``) must fit the model's
  positions (``models.shape``: its config or GGUF header, read without the weights), unless
  ``beyond_positions`` lets the run go past them (up to the ranges of ``slmedge.limits``).
- Threads: at most the cores they run on (the target's).
- Memory: what the evaluation allocates for its settings, estimated, against what the target has
  now (``Transport.memory_available``). The estimate counts the KV cache (at the context for a
  runtime that allocates it whole when a file opens, llama.cpp; else at the longest sequence run),
  the logits of the longest sequence (llama.cpp: its scores and its output buffer; torch and
  onnxruntime: the logits, their log-softmax and one more copy), one layer's attention scores, and
  the same again for the fidelity reference (torch, at the window). Not the weights: the runtime
  maps or streams them (``evaluate.subject.torch_streamed``), and the memory metric measures them.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..limits import check_length, check_memory, check_threads
from ..models.shape import ModelShape, model_shape
from ..runtimes.registry import get_runtime


def option(name: str, cli: bool) -> str:
    return f"--{name.replace('_', '-')}" if cli else name


def check_lengths(settings, shape: ModelShape | None, cli: bool = False) -> None:
    """The settings' lengths against ``shape``'s positions (nothing when they are not known)."""
    if shape is None or shape.positions is None:
        return
    advice = ("--beyond-positions runs past them" if cli else "beyond_positions = true runs past them")
    metrics = set(settings.metrics)
    lengths = [("seqlen", settings.seqlen)] + ([("context", settings.context)] if settings.context else [])
    if "latency" in metrics:
        lengths.append(("pp", settings.pp + settings.tg))
    for name, value in lengths:
        shown = option(name, cli)
        if name == "pp":  # the prompt and the tokens generated after it share the positions
            shown = f"{option('pp', cli)} + {option('tg', cli)}"
        check_length(shown, value, shape.positions, shape.positions_from, beyond=settings.beyond_positions,
                     option=shown, advice=advice)


def longest_sequence(settings) -> int:
    """The most tokens one forward pass of the evaluation runs: a perplexity or fidelity window, or
    the latency run's prompt and generated tokens."""
    longest = settings.seqlen if {"perplexity", "fidelity"} & set(settings.metrics) else 0
    if "latency" in settings.metrics:
        longest = max(longest, settings.pp + settings.tg)
    return max(longest, 1)


def evaluation_memory(shape: ModelShape, settings, runtime: str) -> int | None:
    """Bytes the evaluation allocates for its settings (the module's docstring says what is counted);
    None when the shape lacks what the estimate needs."""
    if not (shape.layers and shape.kv_heads and shape.head_dim and shape.vocab and shape.heads):
        return None
    spec = get_runtime(runtime)
    used = longest_sequence(settings)
    n_ctx = settings.resolved(shape.positions).n_ctx  # what a file opens with

    def one(kv_tokens: int, kv_bytes: int, copies: int, rows: int) -> int:
        kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * kv_tokens * kv_bytes
        logits = used * shape.vocab * 4 * copies
        attention = shape.heads * min(used, rows) * used * 4
        return kv + logits + attention

    if spec.holds_context:  # llama.cpp: KV cache cleared at n_ctx; logits of the tokens run; ubatch of 512
        total = one(n_ctx, spec.kv_bytes_per_value, 2, 512)
    else:
        total = one(used, spec.kv_bytes_per_value, 3, used)
    if "fidelity" in settings.metrics:
        total += one(min(used, settings.seqlen), 4, 3, used)
    return total


def check_memory_fits(shape: ModelShape | None, settings, runtime: str, profile, cli: bool = False) -> None:
    from ..targets.registry import transport_class

    if shape is None:
        return
    needed = evaluation_memory(shape, settings, runtime)
    available = transport_class(profile.transport).memory_available(profile)
    used = longest_sequence(settings)
    tokens = f"{used} token{'s' if used != 1 else ''}"
    if get_runtime(runtime).holds_context:
        counts = (f"the KV cache of its context of {settings.resolved(shape.positions).n_ctx} tokens, the logits and "
                  f"attention scores of {tokens}")
        lower = ", ".join(option(n, cli) for n in ("context", "seqlen", "pp", "tg"))
    else:
        counts = f"the KV cache, logits and attention scores of {tokens}"
        lower = ", ".join(option(n, cli) for n in ("seqlen", "pp", "tg"))
    if "fidelity" in settings.metrics:
        counts += ", and the reference's"
    check_memory(needed, available, f"evaluating {shape.where} in {runtime} on target {profile.name}",
                 f"{counts}; not the weights", f"lower {lower}")


def planned_runtime(spec, settings, profile) -> str:
    """The runtime the evaluation of ``spec`` will open on ``profile``'s target (as
    ``subject.open_on_target`` and ``open_subject`` decide it), without opening anything."""
    from ..export.formats import format_for_path
    from ..runtimes.registry import check_runtime_name, source_runtime
    from ..targets.registry import transport_class
    from .subject import _format_runtime

    fmt = format_for_path(Path(str(spec)).expanduser()) if spec else None
    runtime = check_runtime_name(settings.runtime) if settings.runtime else None
    if not transport_class(profile.transport).in_process and runtime is None and fmt is None:
        return profile.default_runtime or profile.runtimes[0]
    if fmt is not None:
        return _format_runtime(fmt, runtime)
    return runtime or source_runtime().name


def check_evaluation_bounds(spec, settings, profile, cli: bool = False) -> ModelShape | None:
    """Every bound the model and the target put on ``settings``, before the model opens; returns
    the model's shape (None: not known before it loads, a Hub id not in the local cache)."""
    from ..targets.registry import transport_class

    check_threads(settings.threads, transport_class(profile.transport).cpu_count(profile), option("threads", cli),
                  f"target {profile.name}")
    shape = model_shape(None if spec is None else str(spec))
    check_lengths(settings, shape, cli)
    if settings.reference and "fidelity" in settings.metrics:
        check_lengths(settings, model_shape(str(settings.reference)), cli)
    runtime = planned_runtime(spec, settings, profile)
    transport = transport_class(profile.transport)
    why = transport.runtime_refusal(profile, runtime) if transport.in_process else None  # the others: on opening
    if why:
        raise ConfigError(f"{why}: evaluate this model with --target cpu")
    check_memory_fits(shape, settings, runtime, profile, cli)
    return shape
