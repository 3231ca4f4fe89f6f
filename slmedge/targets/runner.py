"""The runner that evaluates on a target: a small program the host starts there (a child
process, ``qemu-aarch64`` with an aarch64 Python, or a remote Python over ssh).

It needs only numpy and the runtime (onnxruntime, or llama.cpp's Python binding); the host ships
it as one zip file (``slmedge.targets.bundle``) holding this module and ``slmedge.runtimes``.
Requests come on stdin and replies go to stdout (``slmedge.runtimes.wire``); everything else
anything prints goes to stderr. The host tokenizes and reduces; the runner loads the model,
scores token ids and times generation with the target's own kernels.

    python runner.pyz            # serve requests on stdin/stdout
    python runner.pyz memprobe RUNTIME PATH THREADS TOKENS   # peak RSS of a fresh process
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import traceback


def _versions() -> dict:
    out = {"python": platform.python_version(), "machine": platform.machine(), "system": platform.system(),
           "cpu_count": os.cpu_count()}
    try:
        import numpy

        out["numpy"] = numpy.__version__
    except ImportError:
        out["numpy"] = None
    from slmedge.runtimes.registry import RUNTIMES

    for spec in RUNTIMES.values():
        if not spec.runs_files or not spec.module:
            continue
        try:
            mod = __import__(spec.module)
            out[spec.name] = getattr(mod, "__version__", "?")
        except Exception:  # noqa: BLE001 - missing, or broken on this target: both mean "not available"
            out[spec.name] = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    out["mem_total_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def _sha256(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _open(req: dict):
    from slmedge.runtimes.memprobe import open_file_runtime

    layers = int(req.get("n_gpu_layers", 0))
    rt = open_file_runtime(req["runtime"], req["path"], req.get("threads"), n_ctx=int(req.get("n_ctx", 2048)),
                           gpu=layers != 0, gpu_layers=layers)
    return rt, rt.runner_info()


def serve(inp, out) -> None:
    import numpy as np

    from slmedge.runtimes import wire

    rt = None
    while True:
        try:
            req, arrays = wire.recv(inp)
        except wire.WireError:
            return
        op = req.get("op")
        try:
            if op == "hello":
                wire.send(out, {"ok": True, "versions": _versions()})
            elif op == "sha256":
                wire.send(out, {"ok": True, "sha256": _sha256(req["path"])})
            elif op == "open":
                if rt is not None:
                    rt.close()
                rt, info = _open(req)
                wire.send(out, {"ok": True, **info})
            elif op == "logits":
                wire.send(out, {"ok": True}, [rt.logits([int(t) for t in arrays[0]]).astype(np.float32)])
            elif op == "score_groups":
                groups = [(g["context"], g["continuations"]) for g in req["groups"]]
                scored = rt.score_groups(groups)
                flat = [lp for group in scored for lp, _ in group]
                greedy = [[bool(g) for _, g in group] for group in scored]
                lps = np.concatenate(flat).astype(np.float64) if flat else np.zeros(0)
                wire.send(out, {"ok": True, "greedy": greedy}, [lps])
            elif op == "timed_generate":
                t = rt.timed_generate([int(x) for x in req["prompt"]], int(req["n"]))
                wire.send(out, {"ok": True, "timing": t.__dict__})
            elif op == "close":
                if rt is not None:
                    rt.close()
                wire.send(out, {"ok": True})
                return
            else:
                wire.send(out, {"ok": False, "type": "ValueError", "error": f"unknown request {op!r}"})
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the host as a reply
            traceback.print_exc(file=sys.stderr)
            wire.send(out, {"ok": False, "type": type(exc).__name__, "error": str(exc)})


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "memprobe":  # memprobe RUNTIME PATH THREADS TOKENS [N_GPU_LAYERS]
        from slmedge.runtimes.memprobe import open_file_runtime, peak_rss, probe

        before = peak_rss()
        n = int(argv[4])
        layers = int(argv[5]) if len(argv) > 5 else 0
        rt = open_file_runtime(argv[1], argv[2], int(argv[3]), n_ctx=max(n + 8, 64), gpu=layers != 0,
                               gpu_layers=layers)
        print(json.dumps(probe(rt, n, before)))
        return 0
    if argv and argv[0] == "versions":
        print(json.dumps(_versions()))
        return 0
    # The protocol owns stdout; whatever else prints goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin.buffer, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
