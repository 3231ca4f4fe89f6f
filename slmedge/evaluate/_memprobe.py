"""Child process of the memory metric: load a model in a runtime, run one prefill, print peak RSS.

    python -m slmedge.evaluate._memprobe SPEC RUNTIME THREADS PROMPT_TOKENS

llama.cpp and onnxruntime files are opened without importing torch, so the peak is what a
deployment of that runtime would hold (plus Python and numpy).
"""

import json
import resource
import sys


def main() -> None:
    spec, runtime, threads, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    before = _peak_rss()
    if runtime == "llama.cpp":
        from ..runtimes import LlamaCppRuntime

        rt = LlamaCppRuntime(spec, threads, n_ctx=max(n + 8, 64))
    elif runtime == "onnxruntime":
        from ..runtimes import OnnxRuntime

        rt = OnnxRuntime(spec, threads)
    else:
        from .subject import open_subject

        rt = open_subject(spec, runtime, threads).runtime
    vocab = rt.vocab_size if rt.vocab_size > 0 else 32000
    ids = [(7 * i + 11) % max(vocab - 1, 2) + 1 for i in range(n)]
    rt.logits(ids)
    print(json.dumps({"peak_rss_bytes": _peak_rss(), "baseline_rss_bytes": before, "prompt_tokens": n}))


def _peak_rss() -> int:
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


if __name__ == "__main__":
    main()
