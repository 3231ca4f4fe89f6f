"""Child process of the memory metric: load a model in a runtime, run one prefill, print peak RSS.

    python -m slmedge.evaluate._memprobe SPEC RUNTIME THREADS PROMPT_TOKENS [streamed|whole]

llama.cpp and onnxruntime files are opened without importing torch, so the peak is what a
deployment of that runtime would hold (plus Python and numpy).
"""

import json
import sys

from ..runtimes.memprobe import open_file_runtime, peak_rss, probe
from ..runtimes.registry import get_runtime


def main() -> None:
    spec, runtime, threads, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    before = peak_rss()
    if get_runtime(runtime).runs_files:
        rt = open_file_runtime(runtime, spec, threads, n_ctx=max(n + 8, 64))
    else:
        from .subject import open_subject

        mode = sys.argv[5] if len(sys.argv) > 5 else None  # torch: streamed or whole, as the evaluation ran it
        rt = open_subject(spec, runtime, threads, streamed=None if mode is None else mode == "streamed").runtime
    print(json.dumps(probe(rt, n, before)))


if __name__ == "__main__":
    main()
