#!/usr/bin/env python
"""Benchmark: slmedge's compressed-tensors checkpoint against llm-compressor's, and each in the other's reader.

SmolLM2-135M (the embedded default), GPTQ W4 g32 (symmetric, llm-compressor's default; static
act-order on both sides), the same C4 calibration token ids for both. Prints, per checkpoint, its
bytes on disk by kind of tensor (packed codes, scales, zero points, dense tensors per dtype), and
whether each loads in the other tool's reader, with the logits' agreement:

- ours: ``slmedge compress`` then ``slmedge export --format compressed-tensors`` (slmedge's .venv:
  the compressed-tensors release it has, 0.17-0.20, and transformers 5);
- theirs: llm-compressor's ``oneshot`` + ``save_pretrained(save_compressed=True)`` in its own
  virtualenv (benchmarks/llmc_env.sh: transformers 5.17, the compressed-tensors llmcompressor pins);
- each checkpoint is loaded by ``AutoModelForCausalLM.from_pretrained`` in both environments and
  its logits on the probe compared: ours against the artifact's own weights, theirs across readers;
- both checkpoints are read by the compressed-tensors readers of vLLM 0.33 (0.17.0, transformers 5.20)
  and llm-compressor 0.14 (0.19.0, transformers 5.17) in their own virtualenvs
  (benchmarks/ct_readers.sh, benchmarks/ct_reader.py): ours must decode to the artifact's weights
  bit for bit (transformers' fp32 load) and give its logits.

The size of a checkpoint does not depend on how much calibration data chose its codes, so the
calibration is small by default (16 x 256 tokens) to keep the run short on 2 cores.

    .venv/bin/python benchmarks/compressed_tensors_peers.py
    .venv/bin/python benchmarks/compressed_tensors_peers.py --nsamples 32 --seqlen 512 --keep .bench/ct
    .venv/bin/python benchmarks/compressed_tensors_peers.py --no-peer   # ours, in every reader
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

import numpy as np
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compress_peers import peer_python  # noqa: E402 - beside this file
from slmedge.compress.api import compress  # noqa: E402
from slmedge.compress.recipe import Recipe  # noqa: E402
from slmedge.data.calibration import load_calibration  # noqa: E402
from slmedge.export.compressed_tensors import export_compressed_tensors, load_checkpoint  # noqa: E402
from slmedge.export.verify import probe_text, source_tokenizer, torch_logits  # noqa: E402
from slmedge.models.artifact_format import safetensors_header  # noqa: E402
from slmedge.models.source import load  # noqa: E402

# What runs in llm-compressor's virtualenv to load a checkpoint: fp32 logits of the ids, or the error.
READER = r"""
import json, sys, numpy as np, torch
from transformers import AutoModelForCausalLM
path, ids_file, out = sys.argv[1:4]
ids = torch.tensor([json.load(open(ids_file))])
try:
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        np.save(out, m(ids).logits[0].float().numpy())
    print(json.dumps({"status": "ok"}))
except Exception as exc:
    print(json.dumps({"status": "error", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}))
"""


def storage(folder: Path) -> dict:
    """kind -> bytes of a checkpoint's safetensors (from the headers), plus 'total' and 'all files'."""
    out: dict[str, int] = {}
    for f in sorted(folder.glob("*.safetensors")):
        header = safetensors_header(f) or {}
        data = 0
        for key, info in header.items():
            if key == "__metadata__":
                continue
            start, end = info["data_offsets"]
            data += end - start
            leaf = key.rsplit(".", 1)[1]
            kind = leaf if leaf.startswith("weight_") else f"dense {info['dtype'].lower()}"
            out[kind] = out.get(kind, 0) + end - start
        out["headers"] = out.get("headers", 0) + f.stat().st_size - data
    out["total"] = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    out["all files"] = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())  # with tokenizer files
    return out


def compare(ref: np.ndarray, got: np.ndarray) -> dict:
    from slmedge.export.verify import compare_logits

    s = compare_logits(ref, got)
    return {"max_abs_logit_diff": float(s["max_abs_logit_diff"]), "mean_kl": float(s["mean_kl"]),
            "top1_agreement": float(s["top1_agreement"])}


def their_reader(peer_py: Path, folder: Path, ids_file: Path, work: Path, name: str):
    out = work / f"{name}.npy"
    p = subprocess.run([str(peer_py), "-c", READER, str(folder), str(ids_file), str(out)], capture_output=True,
                       text=True, timeout=1800)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    status = json.loads(lines[-1]) if lines else {"status": "error", "error": (p.stderr or "no output")[-300:]}
    return (np.load(out) if status["status"] == "ok" else None), status


READER_VERSIONS = ("0.17.0", "0.19.0")  # vLLM 0.33's and llm-compressor 0.14's compressed-tensors


def ct_readers(checkpoints: dict[str, Path], ids: list[int], work: Path) -> dict:
    """Each checkpoint read by each compressed-tensors reader (benchmarks/ct_reader.py in the reader's
    virtualenv, made by benchmarks/ct_readers.sh): version -> its results.json and output folder."""
    subprocess.run(["bash", str(ROOT / "benchmarks" / "ct_readers.sh")], check=True)
    root = Path(os.environ.get("CT_READERS_DIR") or ROOT / ".bench" / "ct-readers")
    runs = {}
    for version in READER_VERSIONS:
        out = work / f"read-{version}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        (out / "jobs.json").write_text(json.dumps({"ids": ids, "checkpoints": {k: str(v) for k, v in checkpoints.items()}}))
        t = time.perf_counter()
        subprocess.run([str(root / f"ct-{version}" / "bin" / "python"), str(ROOT / "benchmarks" / "ct_reader.py"),
                        str(out / "jobs.json"), str(out)], check=True, env={**os.environ, "PYTHONPATH": ""},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        runs[version] = (json.loads((out / "results.json").read_text()), out, round(time.perf_counter() - t, 1))
    return runs


def weights_match(art: Path, decoded_file: Path, names) -> dict:
    """How many of the artifact's compressed linears a reader decoded to the artifact's weights bit for bit."""
    from safetensors import safe_open

    from slmedge.models.artifact_weights import load_model

    mine = load_model(art).state_dict()
    equal, worst = 0, 0.0
    with safe_open(str(decoded_file), framework="pt") as f:
        for name in names:
            got, want = f.get_tensor(f"{name}.weight"), mine[f"{name}.weight"]
            equal += int(torch.equal(got, want))
            worst = max(worst, float((got - want).abs().max()))
    return {"linears": len(names), "bit_equal": equal, "max_abs_weight_diff": worst}


def our_reader(folder: Path, ids: list[int]):
    try:
        model = load_checkpoint(folder)
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().numpy(), {"status": "ok"}
    except Exception as exc:  # noqa: BLE001 - the reader's own failure is the measurement
        return None, {"status": "error", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nsamples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--no-peer", action="store_true", help="only our checkpoint")
    ap.add_argument("--no-readers", action="store_true",
                    help="skip the compressed-tensors 0.17.0 / 0.19.0 readers (benchmarks/ct_readers.sh)")
    ap.add_argument("--keep", default=None, help="keep the checkpoints in this folder")
    ap.add_argument("--out", default=str(ROOT / ".bench" / "compressed_tensors_results.json"))
    args = ap.parse_args()

    work = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="slmedge-ct-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    peer_py = None if args.no_peer else peer_python()

    base = load(None)
    hf_dir = base.hf_dir
    calib = load_calibration("c4", base.tokenizer, args.nsamples, args.seqlen, seed=0).tokens
    del base
    save_file({"input_ids": calib.contiguous()}, str(work / "calib.safetensors"))
    save_file({"input_ids": calib[:1, :128].contiguous()}, str(work / "eval.safetensors"))
    results: dict = {"model": "SmolLM2-135M", "grid": f"GPTQ W4 g{args.group_size} sym",
                     "calibration": f"C4 {args.nsamples} x {args.seqlen}", "time": time.strftime("%Y-%m-%d %H:%M:%S")}

    # ours: compress, then export
    art, ours = work / "slmedge-artifact", work / "slmedge-ct"
    for p in (art, ours):
        shutil.rmtree(p, ignore_errors=True)
    t = time.perf_counter()
    compress(None, Recipe(method="gptq", bits=4, group_size=args.group_size, symmetric=True, nsamples=args.nsamples,
                          seqlen=args.seqlen), art, device="cpu")
    results["ours_compress_s"] = round(time.perf_counter() - t, 1)
    report = export_compressed_tensors(art, ours)
    results["ours_export_s"] = report["seconds"]
    results["ours_export_verification"] = {k: report["verification"][k] for k in ("max_abs_logit_diff", "mean_kl")}
    results["ours_bytes"] = storage(ours)
    ids = source_tokenizer(art)(probe_text(), add_special_tokens=True)["input_ids"]
    ids_file = work / "ids.json"
    ids_file.write_text(json.dumps(ids))
    artifact_logits = torch_logits(art, ids)
    print(f"ours: compress {results['ours_compress_s']} s, export {report['seconds']} s, "
          f"checkpoint {results['ours_bytes']['total']:,} bytes", flush=True)

    if peer_py is not None:
        theirs = work / "llmc-ct"
        shutil.rmtree(theirs, ignore_errors=True)
        recipe = {"method": "gptq", "bits": 4, "group_size": args.group_size, "symmetric": True}
        t = time.perf_counter()
        subprocess.run([str(peer_py), str(ROOT / "benchmarks" / "llmc_worker.py"), "--model", str(hf_dir),
                        "--calib", str(work / "calib.safetensors"), "--eval", str(work / "eval.safetensors"),
                        "--recipe", json.dumps(recipe), "--out", str(work / "llmc.json"), "--save-dir", str(theirs)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        peer = json.loads((work / "llmc.json").read_text()) if (work / "llmc.json").is_file() else {}
        results["theirs_run"] = {k: peer.get(k) for k in ("status", "seconds", "versions", "error", "save_error")}
        results["theirs_wall_s"] = round(time.perf_counter() - t, 1)
        if (theirs / "config.json").is_file():
            results["theirs_bytes"] = storage(theirs)
            results["theirs_quantization_config"] = json.loads((theirs / "config.json").read_text()).get(
                "quantization_config")
            # each checkpoint in each reader
            ours_in_theirs, s1 = their_reader(peer_py, ours, ids_file, work, "ours_in_theirs")
            theirs_in_theirs, s2 = their_reader(peer_py, theirs, ids_file, work, "theirs_in_theirs")
            theirs_in_ours, s3 = our_reader(theirs, ids)
            results["ours_in_their_reader"] = {**s1, **(compare(artifact_logits, ours_in_theirs)
                                                        if ours_in_theirs is not None else {})}
            results["theirs_in_their_reader"] = s2
            results["theirs_in_our_reader"] = {**s3, **(compare(theirs_in_theirs, theirs_in_ours)
                                                        if theirs_in_ours is not None and theirs_in_theirs is not None
                                                        else {})}
    if not args.no_readers:
        checkpoints = {"ours": ours}
        if peer_py is not None and (work / "llmc-ct" / "config.json").is_file():
            checkpoints["theirs"] = work / "llmc-ct"
        layers = sorted(json.loads((art / "slmedge.json").read_text())["layers"])
        results["readers"] = {}
        for version, (res, out, seconds) in ct_readers(checkpoints, ids, work).items():
            entry = {"versions": res["versions"], "seconds": seconds, "checkpoints": res["checkpoints"]}
            ours_read = res["checkpoints"]["ours"]
            if ours_read["transformers"]["status"] == "ok":
                entry["ours_weights"] = weights_match(art, out / "ours.transformers.safetensors", layers)
                entry["ours_logits"] = compare(artifact_logits, np.load(out / "ours.logits.npy"))
            if "theirs" in checkpoints and res["checkpoints"]["theirs"]["transformers"]["status"] == "ok" \
                    and results.get("theirs_in_their_reader", {}).get("status") == "ok":
                theirs_ref = np.load(work / "theirs_in_theirs.npy")
                entry["theirs_logits_vs_llmc_env"] = compare(theirs_ref, np.load(out / "theirs.logits.npy"))
            results["readers"][version] = entry
    ours_in_ours, s0 = our_reader(ours, ids)
    results["ours_in_our_reader"] = {**s0, **(compare(artifact_logits, ours_in_ours) if ours_in_ours is not None else {})}

    print()
    print(f"{results['model']} {results['grid']}, calibration {results['calibration']}")
    kinds = sorted(set(results["ours_bytes"]) | set(results.get("theirs_bytes", {})))
    print(f"{'bytes':<22} {'slmedge':>14} {'llm-compressor':>15}")
    for k in kinds:
        a, b = results["ours_bytes"].get(k), results.get("theirs_bytes", {}).get(k)
        print(f"{k:<22} {'-' if a is None else format(a, ','):>14} {'-' if b is None else format(b, ','):>15}")
    for key in ("ours_in_our_reader", "ours_in_their_reader", "theirs_in_our_reader", "theirs_in_their_reader"):
        if key in results:
            print(f"{key:<24} {json.dumps(results[key])}")
    for version, entry in results.get("readers", {}).items():
        v = entry["versions"]
        print(f"reader compressed-tensors {v['compressed-tensors']} + transformers {v['transformers']} "
              f"({entry['seconds']} s):")
        for name, readings in entry["checkpoints"].items():
            print(f"  {name:<7} " + ", ".join(f"{k} {r['status'] if r['status'] != 'error' else r['error'][:80]}"
                                              for k, r in readings.items()))
        for key in ("ours_weights", "ours_logits", "theirs_logits_vs_llmc_env"):
            if key in entry:
                print(f"  {key:<26} {json.dumps(entry[key])}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(f"\nresults: {args.out}; checkpoints in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
