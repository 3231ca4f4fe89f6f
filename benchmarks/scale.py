#!/usr/bin/env python
"""Benchmark (issue 17): peak memory, time and sizes of every stage, on each shipped shape.

    .venv/bin/python benchmarks/scale.py                                    # all six shapes, smallest first
    .venv/bin/python benchmarks/scale.py --shapes Qwen2.5-0.5B-Instruct --layers 2   # a quick run
    .venv/bin/python benchmarks/scale.py --shapes Phi-3.5-mini-instruct --stages rtn,gguf --json out.json

For each shape (random bf16 weights made by scripts/make_random_model.py; random weights say
nothing about quality, everything about memory and time), each stage in its own child process,
one after the other, never two at once, in this order (the slow ones last):

- rtn:   slmedge compress MODEL --method rtn --bits 4 --group-size 128
- gguf:  slmedge export RTN --format gguf --type q4_1 --exact --keep-f16-uncoded --no-verify (the g128
         codes kept: every Q4_1 32-block lies inside one 128-group, so its d and m are the group's
         scale and zero). --no-verify: on the random Qwen-shape models (SmolLM2's tokenizer in a
         151,936-row vocabulary) the verification aborts inside llama.cpp's tokenizer
         (llama_vocab::byte_to_token, std::out_of_range), issue-17 report; the ppl stage shows
         whether llama.cpp can run the file.
- onnx:  slmedge export RTN --format onnx --type int4 (MatMulNBits, the codes kept); --onnx-no-verify
         adds --no-verify: on random weights the logits are nearly flat, so the verification's
         top-1 agreement is noise and can refuse a correct file (Phi-3.5-mini's shape: 73% < 85%)
- ppl:   slmedge evaluate GGUF --runtime llama.cpp --metrics perplexity --langs en --no-wikitext
         --ppl-windows 1 --seqlen 512 (one 512-token window of NTREX English in llama.cpp)
- wanda: slmedge compress MODEL --method wanda --sparsity 0.5 (the default calibration, or
         --wanda-nsamples N with --seqlen's tokens per sample)
- gptq:  slmedge compress MODEL --method gptq --bits 4 --group-size 128 --nsamples 16 --seqlen 512
- awq:   slmedge compress MODEL --method awq --bits 4 --group-size 128 (slmedge's default calibration,
         128 x 512 tokens, as `slmedge compress` runs it; or --awq-nsamples N of --seqlen tokens).
         Not in the default stages (the slowest: run it with --stages awq)

gguf, onnx and ppl need the RTN artifact (gguf for ppl); a stage whose input is missing is skipped.
Recorded per stage: wall time, CPU time (user + system of the child and of the children it
waited for) and peak RSS: the kernel's ru_maxrss from wait4, the high-water mark of the child (or
of its largest waited-for descendant), not a sample. A watchdog also samples the summed RSS of
the child's process group every 0.5 s and kills the group above --max-rss-gb (default 14).

Sizes against their theoretical bytes, from the model's safetensors headers (nothing loaded):
- artifact (rtn, gptq, awq): quantized linears n*b/8 + groups*(2 [fp16 scale] + b/8 [a b-bit zero
  point]), groups = rows*ceil(cols/128); every other tensor (embedding, head, norms, biases) bf16.
- wanda: each pruned linear as its kept values in bf16 (cols - floor(cols * 0.5) a row) plus a bit mask
  (ceil(cols/8) bytes a row); every other tensor bf16.
- gguf q4_1: quantized linears 20 bytes per 32 weights (16 B of 4-bit codes + fp16 d + fp16 m);
  every other tensor f16 (--keep-f16-uncoded; norms are f32 in GGUF: a few KB).
- onnx int4: quantized linears as the artifact (codes, fp16 scale and 4-bit zero per 128 block);
  the head 8-bit with an fp16 scale per 32 (1.0625 bytes a weight; a tied embedding is written
  twice: fp16 embedding and 8-bit head); every other tensor at 2 bytes.

The machine's 1-minute load average before and after each stage is printed: on a shared machine
(other work on the same cores) wall times are those of a shared machine; CPU seconds are the
comparable figure. Memory is not affected. At the end, a Markdown table and, per stage, a linear
fit of wall and CPU time against parameters (slope s per billion parameters, intercept, R^2) over
the shapes that ran in full (not with --layers).

Everything is written under --work-dir (default the system's temp dir); each shape's model and
outputs are deleted once the shape is done unless --keep. Before each stage the available memory
(MemAvailable) is checked against an estimate of the stage's need (1.3x the bf16 weights + 1.5 GB);
a stage that does not fit is not started. --deadline HH:MM (UTC) kills a stage still running then
and starts none after it (the row is marked partial).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SHAPES = ROOT / "slmedge" / "data" / "shapes" / "shapes.json"
STAGES = ("rtn", "gguf", "onnx", "ppl", "wanda", "gptq", "awq")  # the order they run in: the slow ones last
DEFAULT_STAGES = STAGES[:-1]  # awq (the default method, at its default 128 x 512 tokens) only when asked
GROUP = 128
BITS = 4
SPARSITY = 0.5  # Wanda's


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def shapes_by_size() -> list[tuple[str, int]]:
    data = json.loads(SHAPES.read_text())["shapes"]
    return sorted(((k, v["parameters"]) for k, v in data.items()), key=lambda kv: kv[1])


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def group_rss(pgid: int) -> int:
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) != pgid:  # field 5: pgrp
                continue
            total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # field 24: rss pages
        except (OSError, ValueError, IndexError):
            continue
    return total


def run_stage(cmd: list[str], log: Path, max_rss: int, deadline: float | None) -> dict:
    """Run ``cmd`` in its own process group; wall, CPU, peak RSS (wait4), exit status, kill reason."""
    load_before = os.getloadavg()
    started = time.perf_counter()
    killed = {"why": None, "sampled_peak": 0}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        done = threading.Event()

        def watch():
            while not done.wait(0.5):
                rss = group_rss(proc.pid)
                killed["sampled_peak"] = max(killed["sampled_peak"], rss)
                why = None
                if rss > max_rss:
                    why = f"killed: RSS {rss / 1e9:.1f} GB above {max_rss / 1e9:.1f} GB"
                elif deadline is not None and time.time() > deadline:
                    why = "killed at the deadline"
                if why:
                    killed["why"] = why
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            done.set()
    wall = time.perf_counter() - started
    try:  # anything the child left in its group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    rc = os.waitstatus_to_exitcode(status)
    proc.returncode = rc
    return {"cmd": cmd, "rc": rc, "wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "peak_rss_bytes": usage.ru_maxrss * 1024, "sampled_group_peak_bytes": killed["sampled_peak"],
            "killed": killed["why"], "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()]}


def safetensors_tensors(model: Path) -> dict[str, list[int]]:
    out = {}
    for f in sorted(model.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = meta["shape"]
    return out


def is_quantized(name: str, shape: list[int]) -> bool:
    """The linears the recipes compress: 2-D weights inside the decoder blocks (embedding, head skipped)."""
    return len(shape) == 2 and ".layers." in name and name.endswith(".weight")


def theoretical(tensors: dict[str, list[int]], tied: bool) -> dict[str, int]:
    q_codes = q_groups = q_n = other = pruned = 0
    for name, shape in tensors.items():
        n = math.prod(shape)
        if is_quantized(name, shape):
            q_n += n
            q_groups += shape[0] * math.ceil(shape[1] / GROUP)
            rows, cols = shape
            kept = cols - int(cols * SPARSITY)  # per row
            pruned += rows * (2 * kept + math.ceil(cols / 8))  # kept values in bf16 + a bit mask
        else:
            other += n
    q_codes = q_n * BITS // 8
    group_meta = q_groups * (2 + BITS / 8)
    # ONNX: the head as 8-bit codes with an fp16 scale per 32 (onnxruntime's block), the rest at 2 bytes;
    # a tied embedding is written twice (fp16 embedding, 8-bit head)
    head = [math.prod(s) for k, s in tensors.items() if k.endswith("lm_head.weight")]
    emb = [math.prod(s) for k, s in tensors.items() if "embed_tokens" in k]
    head_n = head[0] if head else (emb[0] if tied and emb else 0)
    onnx_other = 2 * (other - (head[0] if head else 0)) + head_n * (1 + 2 / 32)
    return {
        "artifact": int(q_codes + group_meta + 2 * other),
        "wanda": int(pruned + 2 * other),
        "gguf": int(q_n // 32 * 20 + 2 * other),
        "onnx": int(q_codes + group_meta + onnx_other),
        "quantized_params": q_n, "other_params": other,
    }


def fit(xs: list[float], ys: list[float]) -> dict | None:
    if len(xs) < 2:
        return None
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    icpt = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (icpt + slope * x)) ** 2 for x, y in zip(xs, ys))
    r2 = 1 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return {"n": n, "slope_s_per_bparam": round(slope * 1e9, 2), "intercept_s": round(icpt, 1), "r2": round(r2, 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/scale.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help="comma-separated shipped shapes (default: all, smallest first)")
    ap.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                    help=f"comma-separated, of: {', '.join(STAGES)} (default: {', '.join(DEFAULT_STAGES)})")
    ap.add_argument("--layers", type=int, default=None, metavar="N", help="cut each model to N layers (quick runs)")
    ap.add_argument("--nsamples", type=int, default=16, help="GPTQ calibration samples (default 16)")
    ap.add_argument("--seqlen", type=int, default=512,
                    help="GPTQ (and, with --wanda-nsamples, Wanda) tokens per sample (default 512)")
    ap.add_argument("--wanda-nsamples", type=int, default=None, metavar="N",
                    help="Wanda calibration samples of --seqlen tokens (default: slmedge's own default)")
    ap.add_argument("--awq-nsamples", type=int, default=None, metavar="N",
                    help="AWQ calibration samples of --seqlen tokens (default: slmedge's own default, 128 x 512)")
    ap.add_argument("--onnx-no-verify", action="store_true",
                    help="export ONNX with --no-verify (random weights: the verification's top-1 is noise)")
    ap.add_argument("--work-dir", type=Path, default=None, help="where models and outputs go (default: temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep each shape's model and outputs")
    ap.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    ap.add_argument("--max-rss-gb", type=float, default=14.0, help="kill a stage whose process group exceeds this")
    ap.add_argument("--deadline", default=None, metavar="HH:MM", help="UTC: kill a stage running then, start none after")
    ap.add_argument("--report", type=Path, nargs="+", default=None, metavar="JSON",
                    help="run nothing: print the table and the fits of earlier --json files, merged")
    args = ap.parse_args(argv)
    if args.report:
        merged = {"shapes": {}}
        for f in args.report:
            merged["shapes"].update(json.loads(f.read_text())["shapes"])
        stages = [s for s in STAGES if any(s in r.get("stages", {}) for r in merged["shapes"].values())]
        print(table(merged, stages))
        print_fits(merged, stages, quick=False)
        return 0

    known = dict(shapes_by_size())
    shapes = [s.strip() for s in args.shapes.split(",")] if args.shapes else list(known)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in shapes if s not in known] + [s for s in stages if s not in STAGES]
    if bad or not shapes or not stages:
        print(f"error: unknown {', '.join(bad) or '(none)'}; shapes: {', '.join(known)}; stages: {', '.join(STAGES)}",
              file=sys.stderr)
        return 2
    shapes.sort(key=lambda s: known[s])
    stages = [s for s in STAGES if s in stages]
    deadline = None
    if args.deadline:
        hh, mm = map(int, args.deadline.split(":"))
        now = dt.datetime.now(dt.timezone.utc)
        deadline = now.replace(hour=hh, minute=mm, second=0, microsecond=0).timestamp()
    base = args.work_dir or Path(tempfile.gettempdir())
    if not base.is_dir():
        print(f"error: --work-dir {base} does not exist", file=sys.stderr)
        return 1
    python = sys.executable
    slm = [python, "-m", "slmedge"]
    max_rss = int(args.max_rss_gb * 1e9)
    results = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join([".venv/bin/python", "benchmarks/scale.py", *(argv or sys.argv[1:])]),
               "cpus": os.cpu_count(), "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
               "layers": args.layers, "shapes": {}}
    print(f"{results['date']}: {os.cpu_count()} CPUs, {results['mem_total_bytes'] / 2**30:.1f} GiB RAM "
          f"(shared with other work: load averages below), stages {','.join(stages)}", flush=True)

    def save():
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")

    stop = False
    for shape in shapes:
        if stop:
            break
        work = Path(tempfile.mkdtemp(prefix=f"slmedge-scale-{shape}-", dir=base))
        res = {"stages": {}, "cut": bool(args.layers)}
        results["shapes"][shape] = res
        try:
            model = work / "model"
            make = [python, str(ROOT / "scripts" / "make_random_model.py"), shape, str(model)]
            if args.layers:
                make += ["--layers", str(args.layers)]
            r = run_stage(make, work / "make.log", max_rss, deadline)
            if r["rc"] != 0:
                sys.stderr.write((work / "make.log").read_text(errors="replace")[-3000:])
                res["make"] = r
                continue
            record = json.loads((model / "slmedge-random-model.json").read_text())
            bf16 = sum(f.stat().st_size for f in model.glob("*.safetensors"))
            cfg = json.loads((model / "config.json").read_text())
            tensors = safetensors_tensors(model)
            theo = theoretical(tensors, bool(cfg.get("tie_word_embeddings")))
            res.update(parameters=record["parameters"], layers=record["layers"], bf16_bytes=bf16, make=r,
                       theoretical=theo)
            print(f"\n## {shape}: {record['parameters']:,} parameters, {record['layers']} layers, bf16 {bf16 / 1e9:.3f} GB "
                  f"(made in {r['wall_s']} s); disk free {shutil.disk_usage(work).free / 1e9:.0f} GB under {work}",
                  flush=True)
            outs = {"rtn": work / "rtn", "gptq": work / "gptq", "wanda": work / "wanda", "awq": work / "awq",
                    "gguf": work / "rtn-q4_1.gguf", "onnx": work / "rtn-onnx-int4"}
            cmds = {
                "rtn": [*slm, "compress", str(model), "--method", "rtn", "--bits", "4", "--group-size", "128",
                        "-o", str(outs["rtn"])],
                "gptq": [*slm, "compress", str(model), "--method", "gptq", "--bits", "4", "--group-size", "128",
                         "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen), "-o", str(outs["gptq"])],
                "awq": [*slm, "compress", str(model), "--method", "awq", "--bits", "4", "--group-size", "128",
                        *([] if args.awq_nsamples is None else
                          ["--nsamples", str(args.awq_nsamples), "--seqlen", str(args.seqlen)]),
                        "-o", str(outs["awq"])],
                "wanda": [*slm, "compress", str(model), "--method", "wanda", "--sparsity", str(SPARSITY),
                          *([] if args.wanda_nsamples is None else
                            ["--nsamples", str(args.wanda_nsamples), "--seqlen", str(args.seqlen)]),
                          "-o", str(outs["wanda"])],
                "gguf": [*slm, "export", str(outs["rtn"]), "--format", "gguf", "--type", "q4_1", "--exact",
                         "--keep-f16-uncoded", "--no-verify", "-o", str(outs["gguf"])],
                "onnx": [*slm, "export", str(outs["rtn"]), "--format", "onnx", "--type", "int4",
                         *(["--no-verify"] if args.onnx_no_verify else []), "-o", str(outs["onnx"])],
                "ppl": [*slm, "evaluate", str(outs["gguf"]), "--runtime", "llama.cpp", "--metrics", "perplexity",
                        "--langs", "en", "--no-wikitext", "--ppl-windows", "1", "--seqlen", "512",
                        "--json", str(work / "ppl.json")],
            }
            needs = {"gguf": outs["rtn"], "onnx": outs["rtn"], "ppl": outs["gguf"]}
            theo_key = {"rtn": "artifact", "gptq": "artifact", "awq": "artifact", "wanda": "wanda", "gguf": "gguf",
                        "onnx": "onnx"}
            for stage in stages:
                if deadline is not None and time.time() > deadline:
                    res["stages"][stage] = {"skipped": "past the deadline"}
                    stop = True
                    continue
                if stage in needs and not needs[stage].exists():
                    res["stages"][stage] = {"skipped": f"needs {needs[stage].name}"}
                    print(f"{stage}: skipped (needs {needs[stage].name})", flush=True)
                    continue
                need = int(1.3 * bf16 + 1.5e9)
                avail = mem_available()
                if avail < need:
                    res["stages"][stage] = {"skipped": f"MemAvailable {avail / 1e9:.1f} GB < estimate {need / 1e9:.1f} GB"}
                    print(f"{stage}: not started: {res['stages'][stage]['skipped']}", flush=True)
                    continue
                r = run_stage(cmds[stage], work / f"{stage}.log", max_rss, deadline)
                r["mem_available_before_bytes"] = avail
                res["stages"][stage] = r
                if r["rc"] != 0:
                    tail = (work / f"{stage}.log").read_text(errors="replace")[-3000:]
                    r["log_tail"] = tail
                    sys.stderr.write(tail)
                    print(f"{stage}: FAILED (exit {r['rc']}{'; ' + r['killed'] if r['killed'] else ''}) after "
                          f"{r['wall_s']} s, peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB", flush=True)
                    save()
                    continue
                if stage in outs:
                    p = outs[stage]
                    size = folder_bytes(p) if p.is_dir() else p.stat().st_size
                    r["size_bytes"] = size
                    r["theoretical_bytes"] = theo[theo_key[stage]]
                    r["size_over_theoretical"] = round(size / theo[theo_key[stage]], 3)
                    r["size_over_bf16"] = round(size / bf16, 3)
                if stage == "ppl":
                    try:
                        r["ppl_json"] = json.loads((work / "ppl.json").read_text())
                    except (OSError, ValueError):
                        pass
                extra = (f", size {r['size_bytes'] / 1e9:.3f} GB = {r['size_over_theoretical']}x theoretical "
                         f"{r['theoretical_bytes'] / 1e9:.3f} GB" if "size_bytes" in r else "")
                print(f"{stage}: {r['wall_s']} s wall, {r['cpu_s']} s CPU, peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB"
                      f"{extra} (load {r['load_before'][0]} -> {r['load_after'][0]}, MemAvailable before "
                      f"{avail / 1e9:.1f} GB)", flush=True)
                save()
        finally:
            save()
            if args.keep:
                print(f"kept: {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)

    print()
    print(table(results, stages))
    results["fits"] = print_fits(results, stages, quick=bool(args.layers))
    save()
    ok = all(r.get("rc", 0) == 0 for res in results["shapes"].values() for r in res.get("stages", {}).values())
    return 0 if ok else 1


def print_fits(results: dict, stages: list[str], quick: bool) -> dict:
    fits = {}
    for stage in stages:
        xs, walls, cpus = [], [], []
        for shape, res in results["shapes"].items():
            r = res.get("stages", {}).get(stage, {})
            if r.get("rc") == 0 and "parameters" in res and not res.get("cut") and not quick:
                xs.append(res["parameters"])
                walls.append(r["wall_s"])
                cpus.append(r["cpu_s"])
        fits[stage] = {"wall": fit(xs, walls), "cpu": fit(xs, cpus)}
    print("\nLinear fit of time against parameters (time = slope x parameters + intercept), full-size shapes only:")
    print("| stage | n | wall slope s/B params | wall intercept s | wall R^2 | CPU slope s/B params | CPU intercept s | CPU R^2 |")
    print("|---|---|---|---|---|---|---|---|")
    for stage, f in fits.items():
        w, c = f["wall"], f["cpu"]
        if w is None:
            print(f"| {stage} | {len([1 for res in results['shapes'].values() if res.get('stages', {}).get(stage, {}).get('rc') == 0])} "
                  f"| n/a (fewer than two shapes) | | | | | |")
        else:
            print(f"| {stage} | {w['n']} | {w['slope_s_per_bparam']} | {w['intercept_s']} | {w['r2']} | "
                  f"{c['slope_s_per_bparam']} | {c['intercept_s']} | {c['r2']} |")
    print("(two shapes give a line through both points: R^2 = 1 by construction)")
    return fits


def table(results: dict, stages: list[str]) -> str:
    rows = ["| shape | params | stage | wall s | CPU s | peak RSS GB | size GB | theoretical GB | size / theor. | load 1-min before -> after |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for shape, res in results["shapes"].items():
        p = f"{res['parameters'] / 1e9:.3f} B" if "parameters" in res else "-"
        if res.get("layers"):
            p += f" ({res['layers']} layers)"
        for stage in stages:
            r = res.get("stages", {}).get(stage)
            if r is None:
                continue
            if "skipped" in r:
                rows.append(f"| {shape} | {p} | {stage} | not run: {r['skipped']} | | | | | | |")
                continue
            status = ("" if r["rc"] == 0 else f" (partial: {r['killed']})" if r.get("killed")
                      else " (partial: killed from outside)" if r["rc"] < 0 else f" (failed: exit {r['rc']})")
            size = f"{r['size_bytes'] / 1e9:.3f}" if "size_bytes" in r else "-"
            theo = f"{r['theoretical_bytes'] / 1e9:.3f}" if "theoretical_bytes" in r else "-"
            ratio = str(r.get("size_over_theoretical", "-"))
            rows.append(f"| {shape} | {p} | {stage}{status} | {r['wall_s']} | {r['cpu_s']} | "
                        f"{r['peak_rss_bytes'] / 1e9:.2f} | {size} | {theo} | {ratio} | "
                        f"{r['load_before'][0]} -> {r['load_after'][0]} |")
    return "\n".join(rows)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
