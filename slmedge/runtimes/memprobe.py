"""Peak resident memory of a process that loads a model and runs one prefill (torch-free, so it
also runs on targets; ``slmedge.evaluate._memprobe`` and the target runner call it)."""

from __future__ import annotations

import resource


def peak_rss() -> int:
    """This process's high-water RSS. VmHWM belongs to the address space exec created, while
    getrusage's ru_maxrss survives exec and can report the parent's peak from before the fork."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def open_file_runtime(runtime: str, path: str, threads: int, n_ctx: int = 2048, n_gpu_layers: int = 0,
                      providers=None):
    from . import LlamaCppRuntime, OnnxRuntime

    if runtime == "llama.cpp":
        return LlamaCppRuntime(path, threads, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers)
    if runtime == "onnxruntime":
        return OnnxRuntime(path, threads, providers=providers)
    raise ValueError(f"a model file runs in llama.cpp or onnxruntime, not {runtime}")


def probe(rt, n: int, before: int) -> dict:
    vocab = rt.vocab_size if rt.vocab_size > 0 else 32000
    ids = [(7 * i + 11) % max(vocab - 1, 2) + 1 for i in range(n)]
    rt.logits(ids)
    return {"peak_rss_bytes": peak_rss(), "baseline_rss_bytes": before, "prompt_tokens": n}
