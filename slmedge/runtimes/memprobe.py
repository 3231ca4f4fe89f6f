"""Peak resident memory of a process that loads a model and runs one prefill (torch-free, so it
also runs on targets; ``slmedge.evaluate._memprobe`` and the target runner call it)."""

from __future__ import annotations

import resource

from ..fsutil import proc_kib_field


def peak_rss() -> int:
    """This process's high-water RSS. VmHWM belongs to the address space exec created, while
    getrusage's ru_maxrss survives exec and can report the parent's peak from before the fork."""
    found = proc_kib_field("/proc/self/status", "VmHWM")
    return found if found is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def open_file_runtime(runtime: str, path: str, threads: int, n_ctx: int = 2048, gpu: bool = False,
                      gpu_layers: int = -1):
    """A model file opened in the registered runtime ``runtime`` in this process."""
    from .registry import get_runtime

    spec = get_runtime(runtime)
    if not spec.runs_files:
        raise ValueError(f"{runtime} runs model sources, not files")
    return spec.open_file(path, threads, n_ctx=n_ctx, gpu=gpu, gpu_layers=gpu_layers)


def probe(rt, n: int, before: int) -> dict:
    vocab = rt.vocab_size if rt.vocab_size > 0 else 32000
    ids = [(7 * i + 11) % max(vocab - 1, 2) + 1 for i in range(n)]
    rt.logits(ids)
    return {"peak_rss_bytes": peak_rss(), "baseline_rss_bytes": before, "prompt_tokens": n}
