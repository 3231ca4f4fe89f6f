"""Memory and latency.

Memory: file size, bits per weight, KV-cache bytes at the context length, and the peak RSS of a
child process that loads the model and runs one prefill (measured in a fresh process so this
one's allocations do not count). Latency: llama-bench's pp/tg split (default pp512, tg128) —
time to first token, prefill and decode tokens/s, median and spread over repeats after a warm-up.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ..errors import SlmedgeError
from ..procs import child_options


def path_bytes(path: Path | None) -> int | None:
    if path is None:
        return None
    p = Path(path)
    if p.is_file():  # an export's model file: with the files its format says belong to it
        from ..export.formats import format_for_path, get_format

        fmt = format_for_path(p)
        files = get_format(fmt).model_files(p) if fmt else [p]
        return sum(q.stat().st_size for q in files)
    if p.is_dir():  # an HF folder or artifact: what the runtime reads (weights)
        from ..models.artifact_format import is_artifact, is_compact

        if is_artifact(p) and is_compact(p):  # the weights are rebuilt from the codes: both files
            return sum(q.stat().st_size for q in p.glob("*.safetensors"))
        return sum(q.stat().st_size for q in p.glob("*.safetensors") if q.name != "quantization.safetensors")
    return None


def kv_cache_bytes(config: dict, context: int, bytes_per_value: int) -> int | None:
    try:
        layers = int(config["num_hidden_layers"])
        kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return 2 * layers * kv_heads * head_dim * context * bytes_per_value


def peak_rss_child(spec: str, runtime: str, threads: int, prompt_tokens: int = 128, timeout: float = 900,
                   streamed: bool = False) -> dict:
    """Load ``spec`` in ``runtime`` in a fresh Python process, run one prefill; its peak RSS. ``streamed``:
    torch runs it one block at a time, as the evaluation did (the child does not decide again)."""
    cmd = [sys.executable, "-m", "slmedge.evaluate._memprobe", spec, runtime, str(threads), str(prompt_tokens),
           "streamed" if streamed else "whole"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ),
                              **child_options())
    except subprocess.TimeoutExpired as exc:
        raise SlmedgeError(f"the memory probe did not finish in {timeout:.0f} s") from exc
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SlmedgeError(f"the memory probe failed: {last[:300]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def latency(runtime, prompt_ids: list[int], n_gen: int = 128, repeats: int = 3, warmup: int = 1) -> dict:
    runs = []
    for i in range(warmup + repeats):
        t = runtime.timed_generate(prompt_ids, n_gen)
        if i >= warmup:
            runs.append(t)

    def stats(values):
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {"prompt_tokens": len(prompt_ids), "generated": n_gen, "repeats": repeats, "threads": runtime.threads,
            "ttft_s": stats([r.ttft_s for r in runs]), "prefill_tps": stats([r.prefill_tps for r in runs]),
            "decode_tps": stats([r.decode_tps for r in runs])}
