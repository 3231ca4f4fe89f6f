"""Rooflines: decode is bound by the bytes moved per token (weights + KV cache) over memory
bandwidth, prefill by the arithmetic (2 x parameters per token) over peak compute.

The ``cpu`` profile's figures are measured on this machine once (a multi-threaded copy for
bandwidth, a float32 matrix product for compute) and cached; other profiles carry published
figures. Every latency figure is reported as measured, bound and the fraction reached; an
emulated target or a profile with nothing measured gets the projection alone, labelled so.
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time

import numpy as np

MEASURE_VERSION = 1


def measure_bandwidth(mb_per_thread: int = 128, threads: int | None = None, repeats: int = 5) -> float:
    """Bytes/s of large array copies (read + write counted), one copy per thread at once."""
    threads = threads or os.cpu_count() or 1
    n = mb_per_thread * (1 << 20) // 8
    src = [np.ones(n) for _ in range(threads)]
    dst = [np.empty(n) for _ in range(threads)]
    best = 0.0
    for _ in range(repeats):
        barrier = threading.Barrier(threads + 1)

        def work(i):
            barrier.wait()
            np.copyto(dst[i], src[i])

        ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in ts:
            t.join()
        dt = time.perf_counter() - t0
        best = max(best, 2 * 8 * n * threads / dt)
    return best


def measure_fp32_flops(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a float32 matrix product (numpy's BLAS, all threads)."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.copy()
    a @ b
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gb() -> float:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 0.0


def detect_this_machine(profile, remeasure: bool = False) -> None:
    """Fill a ``detect = true`` profile with this machine's cores, RAM, bandwidth and compute
    (measured once, cached under the user cache)."""
    from ..fsutil import write_json_atomic
    from ..paths import cache_dir

    cores = os.cpu_count() or 1
    key = {"cpu": _cpu_model(), "cores": cores, "version": MEASURE_VERSION}
    path = cache_dir() / "targets" / "cpu-measured.json"
    found = None
    if path.is_file() and not remeasure:
        try:
            found = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            found = None
    if not found or found.get("key") != key:
        found = {"key": key, "memory_bandwidth_gbs": measure_bandwidth() / 1e9,
                 "peak_fp32_gflops": measure_fp32_flops() / 1e9,
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, found)
    profile.arch = platform.machine()
    profile.cores = cores
    profile.threads = profile.threads or cores
    profile.ram_gb = round(_ram_gb(), 1)
    profile.description = profile.description or key["cpu"]
    profile.memory_bandwidth_gbs = round(found["memory_bandwidth_gbs"], 2)
    profile.peak_fp32_gflops = round(found["peak_fp32_gflops"], 1)
    profile.measured = {"cpu": key["cpu"], "measured_at": found["measured_at"], "cache": str(path),
                        "how": "numpy copy (read+write) on every core; float32 1024^3 matmul"}


def roofline(profile, weight_bytes: int | None, kv_bytes_per_token: int | None, params: int | None,
             context_tokens: int, integer_kernels: bool) -> dict:
    """Decode and prefill bounds (tokens/s) of a model on a profile."""
    out: dict = {"target": profile.name, "bandwidth_gbs": profile.memory_bandwidth_gbs or None}
    if profile.memory_bandwidth_gbs and weight_bytes:
        per_token = weight_bytes + (kv_bytes_per_token or 0) * context_tokens
        out["decode_bytes_per_token"] = per_token
        out["decode_bound_tps"] = profile.memory_bandwidth_gbs * 1e9 / per_token
    peak = profile.peak_int8_gops if integer_kernels and profile.peak_int8_gops else profile.peak_fp32_gflops
    if peak and params:
        out["prefill_peak"] = f"{'int8' if integer_kernels and profile.peak_int8_gops else 'fp32'} {peak:g} G op/s"
        out["prefill_bound_tps"] = peak * 1e9 / (2 * params)
    return out


def set_against(bounds: dict, decode_tps: float | None, prefill_tps: float | None, measured: bool) -> dict:
    """The bound next to what was measured: fraction reached, or the projection alone."""
    out = dict(bounds)
    if not measured:
        out["label"] = "projection (no device measurement)"
        return out
    out["label"] = "measured vs roofline"
    if decode_tps is not None and bounds.get("decode_bound_tps"):
        out["decode_tps"] = decode_tps
        out["decode_fraction"] = decode_tps / bounds["decode_bound_tps"]
    if prefill_tps is not None and bounds.get("prefill_bound_tps"):
        out["prefill_tps"] = prefill_tps
        out["prefill_fraction"] = prefill_tps / bounds["prefill_bound_tps"]
    return out


def detect_cuda(profile) -> None:
    """Fill the ``cuda`` profile from the GPU found: name, memory, bandwidth of a device copy and
    fp32 matrix-product throughput (measured once per GPU, cached). No GPU: left empty."""
    from ..fsutil import write_json_atomic
    from ..paths import cache_dir

    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        profile.measured = {"gpu": None}
        return
    props = torch.cuda.get_device_properties(0)
    key = {"gpu": props.name, "memory": props.total_memory, "version": MEASURE_VERSION}
    path = cache_dir() / "targets" / "cuda-measured.json"
    found = json.loads(path.read_text()) if path.is_file() else None
    if not found or found.get("key") != key:
        x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
        y = torch.empty_like(x)
        y.copy_(x)
        torch.cuda.synchronize()
        best = 0.0
        for _ in range(5):
            t0 = time.perf_counter()
            y.copy_(x)
            torch.cuda.synchronize()
            best = max(best, 2 * x.numel() * 4 / (time.perf_counter() - t0))
        del x, y
        a = torch.randn(8192, 8192, device="cuda")
        torch.backends.cuda.matmul.allow_tf32 = False
        a @ a
        torch.cuda.synchronize()
        flops = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            a @ a
            torch.cuda.synchronize()
            flops = max(flops, 2 * 8192**3 / (time.perf_counter() - t0))
        found = {"key": key, "memory_bandwidth_gbs": best / 1e9, "peak_fp32_gflops": flops / 1e9,
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, found)
    profile.description = props.name
    profile.arch = "cuda"
    profile.cores = props.multi_processor_count
    profile.threads = profile.threads or (os.cpu_count() or 1)
    profile.ram_gb = round(props.total_memory / (1 << 30), 1)
    profile.memory_bandwidth_gbs = round(found["memory_bandwidth_gbs"], 1)
    profile.peak_fp32_gflops = round(found["peak_fp32_gflops"], 1)
    profile.measured = {"gpu": props.name, "measured_at": found["measured_at"], "cache": str(path),
                        "how": "1 GiB device copy (read+write); fp32 8192^3 matmul, TF32 off"}
