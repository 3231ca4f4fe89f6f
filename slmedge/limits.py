"""The range of every number slmedge takes, declared once.

The command line (every numeric option of every command, through ``cli.common.bounded``), the
library's settings (``Recipe.validate``, ``EvalSettings.validate``, ``check_export_options``), the
study file (its keys are those settings' fields, plus its own: seeds, probe tokens and tolerance)
and target profiles (``targets.profiles``) all check their numbers here, by the key of ``LIMITS``;
tests/test_limits.py holds every numeric CLI option to an entry, so a new option without a range
fails there.

Three kinds of bound, each refused before any work starts:

- a range of its own (``Limit``): non-finite values (nan, inf) are never in one, and each end says
  why it is where it is (``why``, shown when a value is past the upper end);
- a length (``Limit.length``: calibration and perplexity windows, prompt and generated tokens,
  context) is also bounded by the model's positions (``max_position_embeddings`` of its config,
  ``context_length`` of a GGUF file), read without loading the weights (``models.shape``), unless
  the user lets a run go past them (``evaluate --beyond-positions``: rotary models extrapolate, and
  measuring how badly is a legitimate question), up to the range's own end;
- memory: what a run allocates for its settings (compress: the calibration activations; evaluate:
  the KV cache and the logits) is estimated first and compared with the memory available
  (``check_memory``); a run that cannot fit is refused with both numbers.

Exit codes: a value out of its range is a bad setting (``ConfigError``, exit 2), and so is a run
that cannot fit in memory (``MemoryLimitError``): it is the setting that has to change.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from .errors import ConfigError

# The longest context any model slmedge runs declares (Llama 3.1, Qwen2.5: 131,072; a few go to
# 1 M with rope scaling): a length past it is a typo, whatever the model.
MAX_LENGTH = 1 << 20
# No CPU a small model is deployed on has more hardware threads; every thread pool allocates
# per-thread state up front (a million threads ended in a Rust panic in the tokenizer's pool).
MAX_THREADS = 1024


@dataclass(frozen=True)
class Limit:
    """The range of one setting: ``lo``..``hi`` (both included unless ``lo_open``/``hi_open``),
    plus ``special`` values outside it that mean something (-1: per channel, all layers)."""

    lo: float
    hi: float
    why: str  # why the range ends where it does: shown when a value is past the upper end
    integer: bool = True
    lo_open: bool = False
    hi_open: bool = False
    special: tuple = ()
    special_means: str = ""  # what the special value stands for ("per channel")
    length: bool = False  # a number of tokens: also bounded by the model's positions
    span: bool = False  # messages give the whole range ("from 2 to 8"), a short one

    def describe(self) -> str:
        """The range as the documentation and messages write it."""
        if self.integer:
            text = f"an integer from {self.lo:,} to {self.hi:,}"
        else:
            text = f"in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"
        if self.special:
            text += " or " + " or ".join(str(s) for s in self.special) + (f" ({self.special_means})"
                                                                          if self.special_means else "")
        return text

    def contains(self, value) -> bool:
        if value in self.special:
            return True
        above = value > self.lo if self.lo_open else value >= self.lo
        below = value < self.hi if self.hi_open else value <= self.hi
        return above and below


def _num(x: float) -> str:
    return f"{int(x):,}" if math.isfinite(x) and float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


# --- the table ------------------------------------------------------------------------------------

LIMITS: dict[str, Limit] = {
    # compression (Recipe fields: the compress and run options, a study's [[methods]] and [calibration])
    "bits": Limit(2, 8, "the code grids of GGUF and ONNX hold 2- to 8-bit codes", span=True),
    "group_size": Limit(1, 1 << 16, "no layer of a model slmedge runs is wider than 65,536 columns; a group "
                        "wider than a layer is one group per row (-1)", special=(-1,), special_means="per channel"),
    "bpw": Limit(3.4375, 8.5, "bits per weight of llama.cpp's grids as GGUF stores them: Q3_K, the smallest "
                 "slmedge writes codes in, 3.4375; Q8_0, the largest, 8.5", integer=False),
    "nsamples": Limit(1, 1 << 16, "GPTQ and AWQ calibrate on 128 samples (llm-compressor: 512): the statistics "
                      "do not change past a few thousand, and the activations of each sample are held for a "
                      "whole block"),
    "seqlen": Limit(8, MAX_LENGTH, "no model slmedge runs has more positions", length=True),
    "seed": Limit(0, 2**64 - 1, "torch's generator takes 64 bits; negative seeds would draw the same windows "
                  "as positive ones"),
    "batch_size": Limit(1, 1 << 16, "a batch larger than the samples is all the samples at once"),
    "damp": Limit(0, 1, "a fraction of the mean of the Hessian's diagonal: 1 or more drowns the statistics",
                  integer=False, hi_open=True),
    "block_size": Limit(1, 1 << 16, "a block wider than the widest layer (65,536 columns) is the whole layer"),
    "awq_grid": Limit(1, 1000, "llm-awq searches 20 points of [0, 1); 1,000 points are 0.001 apart, finer "
                      "than the scales can tell, and each point is a forward of the block's inputs"),
    "awq_max_tokens": Limit(16, MAX_LENGTH, "more tokens than the calibration holds are all of them; the "
                            "search's losses keep that many tokens' activations"),
    "sparsity_m": Limit(2, 1024, "N:M patterns are for kernels that skip zeros in small blocks (2:4, 4:8); "
                        "past 1,024 weights a pattern is unstructured sparsity"),
    # evaluation (EvalSettings fields: the evaluate and run options, a study's [evaluate])
    "eval_seqlen": Limit(2, MAX_LENGTH, "no model slmedge runs has more positions", length=True),
    "stride": Limit(1, MAX_LENGTH, "a stride is at most the window length", length=True),
    "ppl_windows": Limit(1, 100_000, "100,000 windows of 512 tokens are 51 M tokens, 170 times WikiText-2's "
                         "test set; a corpus gives at most the windows it holds"),
    "limit": Limit(1, 1_000_000, "the largest shipped task has 10,042 items; a limit past a file's items "
                   "takes all of them"),
    "ppl_windows_or_all": Limit(1, 100_000, "100,000 windows of 512 tokens are 51 M tokens, 170 times "
                                "WikiText-2's test set; a corpus gives at most the windows it holds", special=(0,),
                                special_means="all the windows a corpus holds"),
    "fidelity_windows": Limit(1, 100_000, "as --ppl-windows: WikiText-2 gives at most the windows it holds"),
    "pp": Limit(1, MAX_LENGTH, "the prompt must fit the model's positions", length=True),
    "tg": Limit(1, MAX_LENGTH, "prompt and generated tokens must fit the model's positions together",
                length=True),
    "repeats": Limit(1, 1000, "the median of 1,000 timed runs moves less than the noise of the machine; "
                     "more is only time"),
    "context": Limit(2, MAX_LENGTH, "the context must fit the model's positions", length=True),
    "threads": Limit(1, MAX_THREADS, "no CPU a small model runs on has more hardware threads; more threads "
                     "than cores only slow the run down (and are refused on the target's cores)"),
    # export
    "export_block_size": Limit(16, 1 << 16, "MatMulNBits takes a power of two of at least 16; a block wider "
                               "than the widest layer (65,536 columns) is the whole layer"),
    "accuracy_level": Limit(0, 4, "MatMulNBits' accuracy levels: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8",
                            span=True),
    # study
    "workers": Limit(1, 1024, "each worker holds a model in memory; no one machine or Ray job runs more "
                     "than 1,024 at once"),
    "probe_tokens": Limit(16, 4096, "a probe of 16 tokens already shows a different kernel; past 4,096 it "
                          "costs more than the metrics it stands for", span=True),
    "probe_tolerance": Limit(0, 100, "nats per token: a difference of 100 nats is no agreement at all",
                             integer=False),
    # report
    "under_mb": Limit(0, 1e9, "a budget of a petabyte selects every file", integer=False, lo_open=True),
    "above_tps": Limit(0, 1e9, "no model decodes a billion tokens a second", integer=False, lo_open=True),
    # target profiles (targets/*.toml); a key left out is "not known" (detected, or no projection)
    "cores": Limit(1, 4096, "Linux supports at most 4,096 CPUs on the architectures slmedge targets"),
    "profile_threads": Limit(1, 4096, "at most the profile's cores (and Linux's 4,096 CPUs)"),
    "ram_gb": Limit(0, 100_000, "no device has 100 TB of memory", integer=False, lo_open=True),
    "memory_bandwidth_gbs": Limit(0, 100_000, "the fastest GPU memory (HBM3e) moves about 8,000 GB/s; "
                                  "100,000 is a typo", integer=False, lo_open=True),
    "peak_fp32_gflops": Limit(0, 1e7, "the fastest accelerators reach about 100 TFLOP/s in fp32; 10 PFLOP/s "
                              "is a typo", integer=False, lo_open=True),
    "peak_int8_gops": Limit(0, 1e8, "the fastest accelerators reach about 5 POP/s in int8; 100 POP/s is a "
                            "typo", integer=False, lo_open=True),
    "gpu_layers": Limit(0, 10_000, "no model has more layers", special=(-1,), special_means="all layers"),
    "port": Limit(1, 65535, "TCP ports are 1 to 65,535", span=True),
    "connect_timeout_s": Limit(0, 3600, "ssh's ConnectTimeout: a host that does not answer within an hour "
                               "is not there", integer=False, lo_open=True),
    "command_timeout_s": Limit(0, 7 * 86400, "a week: no evaluation of a small model takes longer",
                               integer=False, lo_open=True),
}


def check(key: str, value, name: str | None = None, *, none: bool = False):
    """``value`` when it is in the range ``LIMITS[key]`` declares; otherwise a ConfigError naming
    the setting as ``name`` (default: the key), the range, and, past the upper end, why. ``none``:
    None is allowed (a setting left to its default)."""
    limit = LIMITS[key]
    name = name or key
    if value is None and none:
        return value
    if limit.integer:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
    else:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be {limit.describe()} (a finite number), got {value}")
    if limit.contains(value):
        return value
    if limit.span or not limit.integer or limit.special:
        shown = value if limit.integer else _num(value)
        raise ConfigError(f"{name} must be {limit.describe()}, got {shown}"
                          + (f" ({limit.why})" if value > limit.hi else ""))
    if value < limit.lo:
        raise ConfigError(f"{name} must be an integer of at least {limit.lo:,}, got {value}")
    raise ConfigError(f"{name} must be at most {limit.hi:,} ({limit.why}), got {value:,}")


# --- bounds from the model -------------------------------------------------------------------------


def check_length(name: str, value: int, positions: int | None, source: str, *, beyond: bool = False,
                 option: str | None = None, advice: str = "") -> None:
    """A length (tokens) against the model's ``positions`` (None: not known, nothing to check),
    read from ``source`` ("max_position_embeddings in .../config.json"): refused past them unless
    ``beyond`` (the user lets the run go past the trained positions). ``option``: how the advice
    spells the setting (default ``name``); ``advice``: how to go past them where that is allowed."""
    if positions is None or beyond or value <= positions:
        return
    raise ConfigError(f"{name} {value} is longer than the model's {positions} positions ({source}): use "
                      f"{option or name} {positions} or less" + (f"; {advice}" if advice else ""))


# --- bounds from the machine -----------------------------------------------------------------------


class MemoryLimitError(ConfigError):
    """A run whose estimated memory is more than the memory available: its settings must change."""


def gb(n: float) -> str:
    """A memory size for a message: GB from 1 GB (0.5 GB from half a GB), MB below."""
    from .fsutil import mb

    return f"{n / 1e9:.1f} GB" if n >= 5e8 else f"{mb(n)} MB"


def check_memory(needed: int | None, available: int | None, what: str, counts: str, advice: str) -> None:
    """Refuse a run that needs more than is available: ``what`` (the run), ``counts`` (what the
    estimate counts), ``advice`` (the settings that lower it). Unknown numbers are not checked."""
    if needed is None or available is None or needed <= available:
        return
    raise MemoryLimitError(f"{what} needs about {gb(needed)} ({counts}), {gb(available)} available: {advice}")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(threads: int | None, cores: int | None, name: str, where: str) -> None:
    """More threads than the cores they run on only slow a run down (and, emulated, by 15 times):
    refused, naming the cores."""
    if threads is None or not cores or threads <= cores:
        return
    raise ConfigError(f"{name} {threads} is more than the {cores} cores of {where}: use {name} {cores} or less")


# --- names that become paths -----------------------------------------------------------------------

_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=@:,-]{0,99}")


def check_plain_name(value, what: str) -> str:
    """A name that becomes part of a path (a study's name, a label): letters, digits and
    ``_ . + = @ : , -``, starting with a letter or digit, at most 100 characters; never ``..``."""
    if not isinstance(value, str) or not _PLAIN.fullmatch(value) or ".." in value:
        raise ConfigError(f"{what} {value!r} is not a plain name: use letters, digits and _ . + = @ : , - "
                          "(starting with a letter or digit, at most 100 characters, no '..'); it becomes part "
                          "of a file name")
    return value
