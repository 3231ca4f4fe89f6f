#!/usr/bin/env python
"""Benchmark: peak memory, time and artifact size of `slmedge compress` on a seed-study shape.

    .venv/bin/python scripts/bench_memory.py                             # Qwen2.5-0.5B, full size
    .venv/bin/python scripts/bench_memory.py --shape Phi-3.5-mini-instruct --methods rtn
    .venv/bin/python scripts/bench_memory.py --layers 2 --json out.json  # a quick run

One run: makes a random-weight bf16 model of the shape (scripts/make_random_model.py), measures
its size on disk (the bf16 reference of every ratio), then runs, each in its own child process,
one after the other:

- rtn:  slmedge compress MODEL --method rtn --bits 4 --group-size 128
- gptq: slmedge compress MODEL --method gptq --bits 4 --group-size 128 --nsamples 8 --seqlen 256

For each: wall time, the child's peak RSS (the kernel's ru_maxrss of the process, from wait4:
its high-water mark, VmHWM, not a sample) and the artifact's size, with ratios to the bf16
size. Random weights say nothing about quality, everything about memory and time. The machine's
load average before and after each run is printed: on a shared machine the times are those of a
shared machine (memory is not affected). Everything is written under a temporary folder
(--work-dir, default the system's temp dir) and deleted at the end unless --keep.

Baseline (issue 17, before the compact artifact and block-wise loading), measured with
`.venv/bin/python scripts/bench_memory.py --work-dir /tmp/shapes-work` on this 2-core, 23.5 GiB
machine while other engineers' test runs shared the cores (load average 9-11 during RTN and most
of GPTQ): Qwen2.5-0.5B shape, 494,032,768 parameters, bf16 weights 0.988 GB.

| stage | wall s | CPU s | peak RSS GB | RSS / bf16 | artifact GB | artifact / bf16 |
|---|---|---|---|---|---|---|
| make the model | 27.6 | - | 0.80 | 0.81 | - | - |
| rtn W4 g128 | 102.6 | 40.3 | 5.32 | 5.38 | 2.167 | 2.19 |
| gptq W4 g128, 8x256 | 1397.7 | 658.1 | 5.76 | 5.83 | 2.168 | 2.19 |

The artifact is the fp32 model.safetensors (1.976 GB) plus the codes (0.19 GB). The wall times
are those of a shared machine; the CPU seconds are the comparable figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = {
    "rtn": ["--method", "rtn", "--bits", "4", "--group-size", "128"],
    "gptq": ["--method", "gptq", "--bits", "4", "--group-size", "128", "--nsamples", "{nsamples}", "--seqlen", "{seqlen}"],
}


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_measured(cmd: list[str], log: Path) -> dict:
    """Run ``cmd`` as a child; its wall time, peak RSS (ru_maxrss from wait4) and exit status."""
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except KeyboardInterrupt:
            proc.kill()
            proc.wait()
            raise
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"cmd": cmd, "rc": proc.returncode, "wall_s": round(wall, 1), "peak_rss_bytes": usage.ru_maxrss * 1024,
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_memory.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="Qwen2.5-0.5B-Instruct", help="a shipped shape (default Qwen2.5-0.5B-Instruct)")
    ap.add_argument("--layers", type=int, default=None, metavar="N", help="cut the model to N layers (quick runs)")
    ap.add_argument("--methods", default="rtn,gptq", help="comma-separated, of: " + ", ".join(METHODS))
    ap.add_argument("--nsamples", type=int, default=8, help="GPTQ calibration samples (default 8)")
    ap.add_argument("--seqlen", type=int, default=256, help="GPTQ tokens per sample (default 256)")
    ap.add_argument("--work-dir", type=Path, default=None, help="where the model and artifacts go (default: temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the model and the artifacts")
    ap.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        print(f"error: unknown method(s) {', '.join(unknown) or '(none)'}; known: {', '.join(METHODS)}", file=sys.stderr)
        return 2
    python = sys.executable
    slmedge = [python, "-m", "slmedge"]
    base = args.work_dir or Path(tempfile.gettempdir())
    if not base.is_dir():
        print(f"error: --work-dir {base} does not exist", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="slmedge-bench-memory-", dir=base))
    results = {"shape": args.shape, "layers": args.layers, "cpus": os.cpu_count(),
               "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "runs": {}}
    try:
        model = work / "model"
        make = [python, str(ROOT / "scripts" / "make_random_model.py"), args.shape, str(model)]
        if args.layers:
            make += ["--layers", str(args.layers)]
        r = run_measured(make, work / "make.log")
        if r["rc"] != 0:
            sys.stderr.write((work / "make.log").read_text(errors="replace"))
            return 1
        record = json.loads((model / "slmedge-random-model.json").read_text())
        bf16 = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        results.update(parameters=record["parameters"], bf16_bytes=bf16, make=r)
        free = shutil.disk_usage(work).free
        print(f"{args.shape}: {record['parameters']:,} parameters, {record['layers']} layers, bf16 weights "
              f"{bf16 / 1e9:.3f} GB on disk (made in {r['wall_s']} s, peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB); "
              f"{os.cpu_count()} CPUs, {results['mem_total_bytes'] / 2**30:.1f} GiB RAM, {free / 1e9:.0f} GB free "
              f"under {work}", flush=True)
        for method in methods:
            out = work / f"artifact-{method}"
            flags = [f.format(nsamples=args.nsamples, seqlen=args.seqlen) for f in METHODS[method]]
            cmd = [*slmedge, "compress", str(model), *flags, "-o", str(out)]
            r = run_measured(cmd, work / f"{method}.log")
            if r["rc"] != 0:
                sys.stderr.write((work / f"{method}.log").read_text(errors="replace")[-4000:])
                print(f"error: {method} failed (exit {r['rc']})", file=sys.stderr)
                results["runs"][method] = r
                continue
            size = folder_bytes(out)
            files = sorted(((p.stat().st_size, p.relative_to(out).as_posix()) for p in out.rglob("*") if p.is_file()),
                           reverse=True)
            r.update(artifact_bytes=size, artifact_files={name: n for n, name in files[:6]},
                     rss_over_bf16=round(r["peak_rss_bytes"] / bf16, 2), artifact_over_bf16=round(size / bf16, 2))
            results["runs"][method] = r
            print(f"{method}: {r['wall_s']} s wall ({r['cpu_s']} s CPU), peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB "
                  f"= {r['rss_over_bf16']}x bf16, artifact {size / 1e9:.3f} GB = {r['artifact_over_bf16']}x bf16 "
                  f"(load average {r['load_before']} -> {r['load_after']})", flush=True)
        print()
        print(f"| stage | wall s | CPU s | peak RSS GB | RSS / bf16 | artifact GB | artifact / bf16 | load avg |")
        print("|---|---|---|---|---|---|---|---|")
        for method, r in results["runs"].items():
            if r["rc"] == 0:
                print(f"| {method} | {r['wall_s']} | {r['cpu_s']} | {r['peak_rss_bytes'] / 1e9:.2f} | {r['rss_over_bf16']} | "
                      f"{r['artifact_bytes'] / 1e9:.3f} | {r['artifact_over_bf16']} | {r['load_before']}-{r['load_after']} |")
        print(f"(bf16 weights {bf16 / 1e9:.3f} GB; {os.cpu_count()} CPUs; a load average above the CPU count means "
              "other work shared the cores during that run)")
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
        return 0 if all(r["rc"] == 0 for r in results["runs"].values()) else 1
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
