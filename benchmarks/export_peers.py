#!/usr/bin/env python
"""Benchmark: slmedge's GGUF/ONNX exports against llama.cpp's and onnxruntime's own tools, in one run.

On SmolLM2-135M (the embedded default), printed side by side:

1. Our f32/f16 GGUF against llama.cpp's converter (``convert_hf_to_gguf.py`` from the
   llama-cpp-python sdist, same version as the installed wheel) on the same HF folder: same
   tensor names, shapes, types and values; logits of both files in llama.cpp.
2. GGUF from our GPTQ (W4 g32 sym -> Q4_0) and AWQ (W4 g32 asym -> Q4_1) codes against
   llama.cpp's own q4_0, q4_1 and q4_k_m of the same base: file size, WikiText-2 perplexity and
   mean KL against the f32 file in llama.cpp, decode tokens/s (median of repeats).
3. int4 ONNX from our GPTQ and AWQ codes against the fp32 graph + onnxruntime's own int4
   quantizer (``MatMulNBitsQuantizer``, RTN, block 32), both with MatMulNBits accuracy level 4:
   size, perplexity, decode latency.

Caveat printed with the results: the embedded SmolLM2 is itself a Q4_1 GGUF dequantized to
fp32, so llama.cpp's q4_1 of this "base" lands back on the original grid almost exactly.

Everything runs one after the other (never two timed things at once: 2 cores).

    .venv/bin/python benchmarks/export_peers.py
    .venv/bin/python benchmarks/export_peers.py --windows 8 --seqlen 512 --workdir .bench/export
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def llama_cpp_sources(workdir: Path) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist matching the installed version."""
    import importlib.metadata as md

    version = md.version("llama-cpp-python")
    dest = workdir / f"llama_cpp_python-{version}"
    if not (dest / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        log(f"downloading the llama-cpp-python {version} sdist (its converter)")
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps",
                        "--no-binary", ":all:", "-d", str(workdir)], check=True,
                       stdout=subprocess.DEVNULL)
        with tarfile.open(workdir / f"llama_cpp_python-{version}.tar.gz") as tar:
            tar.extractall(workdir, filter="data")
    return dest / "vendor" / "llama.cpp"


def convert_with_llamacpp(src: Path, hf_dir: Path, out: Path, outtype: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py"), NO_LOCAL_GGUF="")
    t = time.perf_counter()
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", outtype,
                    "--outfile", str(out)], check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def compare_gguf_files(a: Path, b: Path) -> dict:
    import gguf

    ra, rb = gguf.GGUFReader(str(a)), gguf.GGUFReader(str(b))
    ta, tb = {t.name: t for t in ra.tensors}, {t.name: t for t in rb.tensors}
    same_names = set(ta) == set(tb)
    common = set(ta) & set(tb)
    diff_type = [n for n in common if ta[n].tensor_type != tb[n].tensor_type]
    diff_shape = [n for n in common if list(ta[n].shape) != list(tb[n].shape)]
    max_abs = 0.0
    for n in common:
        if n in diff_type or n in diff_shape:
            continue
        x, y = np.asarray(ta[n].data), np.asarray(tb[n].data)
        if x.dtype.kind == "f":
            max_abs = max(max_abs, float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max()))
        elif not np.array_equal(x, y):
            max_abs = float("inf")
    return {"tensors": (len(ta), len(tb)), "same_names": same_names, "only_ours": sorted(set(ta) - set(tb))[:5],
            "only_theirs": sorted(set(tb) - set(ta))[:5], "type_differs": sorted(diff_type)[:5],
            "shape_differs": sorted(diff_shape)[:5], "max_abs_value_diff": max_abs}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


class LlamaRunner:
    def __init__(self, path: Path, n_ctx: int, threads: int):
        from slmedge.backends.llamacpp import load_llama, quiet_native_stderr

        with quiet_native_stderr():
            self.llm = load_llama(path, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False,
                                  n_threads=threads, n_threads_batch=threads)

    def logits(self, ids) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(list(ids))
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)

    def decode_tps(self, prompt, steps: int, repeats: int) -> list[float]:
        out = []
        for _ in range(repeats + 1):  # the first is warm-up
            self.llm.reset()
            self.llm.eval(list(prompt))
            tok = int(np.argmax(self.llm.scores[len(prompt) - 1]))
            t = time.perf_counter()
            for i in range(steps):
                self.llm.eval([tok])
                tok = int(np.argmax(self.llm.scores[len(prompt) + i]))
            out.append(steps / (time.perf_counter() - t))
        return out[1:]

    def close(self):
        self.llm.close()


def score(logit_fn, windows, ref_logprobs=None):
    """Perplexity over windows; mean KL against reference log-probs (list per window) if given."""
    nll, n, kls, lps = 0.0, 0, [], []
    for w, ids in enumerate(windows):
        lp = log_softmax(logit_fn(ids))[:-1]
        nll -= float(lp[np.arange(len(ids) - 1), ids[1:]].sum())
        n += len(ids) - 1
        if ref_logprobs is not None:
            ref = ref_logprobs[w]
            kls.append(float((np.exp(ref) * (ref - lp)).sum(-1).mean()))
        lps.append(lp.astype(np.float32))
    return float(np.exp(nll / n)), (float(np.mean(kls)) if kls else 0.0), lps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=ROOT / ".bench" / "export")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--nsamples", type=int, default=32, help="calibration samples (x 512 tokens of C4)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    wd = args.workdir
    wd.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    from slmedge.compress.api import compress
    from slmedge.compress.recipe import Recipe
    from slmedge.evaluate.corpora import load_corpus
    from slmedge.evaluate.perplexity import windows_of
    from slmedge.export.api import source_folder
    from slmedge.export.gguf import QTYPES, export_gguf, llamacpp_quantize
    from slmedge.export.onnx import export_onnx

    # One clean HF folder for both converters: the cached import's tokenizer.model is not a
    # SentencePiece file (transformers writes it from the GGUF), which llama.cpp's converter tries first.
    import shutil

    hf_dir = wd / "smollm2-hf"
    if not (hf_dir / "model.safetensors").is_file():
        src_dir = source_folder("smollm2-135m")
        hf_dir.mkdir(parents=True, exist_ok=True)
        for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (src_dir / f).is_file():
                shutil.copy2(src_dir / f, hf_dir / f)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    windows = [w.tolist() for w in windows_of(tok, load_corpus("wikitext2"), args.seqlen, args.windows)[0]]
    results: dict = {"model": "SmolLM2-135M-Instruct (embedded)", "windows": f"{args.windows} x {args.seqlen} WikiText-2",
                     "threads": args.threads}

    # --- artifacts ------------------------------------------------------------------------------
    arts = {}
    for name, kw in {"gptq": dict(method="gptq", bits=4, group_size=32, symmetric=True),
                     "awq": dict(method="awq", bits=4, group_size=32, symmetric=False)}.items():
        out = wd / f"art-{name}-g32"
        if not (out / "slmedge.json").is_file():
            log(f"compressing {name} (W4 g32, {args.nsamples} x 512 C4 tokens)")
            compress("smollm2-135m", Recipe(calibration="c4", nsamples=args.nsamples, seqlen=512, **kw), out,
                     overwrite=True)
        arts[name] = out

    # --- 1. f32/f16: ours vs llama.cpp's converter ----------------------------------------------
    src = llama_cpp_sources(wd)
    files: dict[str, Path] = {}
    conv = {}
    for t in ("f32", "f16"):
        ours, theirs = wd / f"ours-{t}.gguf", wd / f"llamacpp-{t}.gguf"
        t0 = time.perf_counter()
        export_gguf(hf_dir, ours, t, overwrite=True, verify=False)
        t_ours = time.perf_counter() - t0
        t_theirs = convert_with_llamacpp(src, hf_dir, theirs, t)
        conv[t] = {"ours_s": round(t_ours, 1), "theirs_s": round(t_theirs, 1), **compare_gguf_files(ours, theirs)}
        files[f"ours {t}"], files[f"llama.cpp {t}"] = ours, theirs
    results["converter"] = conv

    # --- 2. quantized GGUFs ----------------------------------------------------------------------
    base_f32 = files["llama.cpp f32"]
    for q in ("q4_0", "q4_1", "q4_k_m"):
        p = wd / f"llamacpp-{q}.gguf"
        if not p.exists():
            llamacpp_quantize(base_f32, p, QTYPES[q], args.threads)
        files[f"llama.cpp {q}"] = p
    for name, q in (("gptq", "q4_0"), ("awq", "q4_1")):
        p = wd / f"ours-{name}-{q}.gguf"
        export_gguf(arts[name], p, q, exact=True, overwrite=True)
        files[f"ours {name.upper()} {q}"] = p

    ref_runner = LlamaRunner(files["ours f32"], args.seqlen, args.threads)
    ppl_ref, _, ref_lp = score(ref_runner.logits, windows)
    ref_runner.close()
    # Same logits: our f32 file vs llama.cpp's f32 file, in llama.cpp.
    their = LlamaRunner(files["llama.cpp f32"], args.seqlen, args.threads)
    ppl_their_f32, kl_between, _ = score(their.logits, windows[:1], ref_lp[:1])
    their.close()
    results["converter"]["f32_logits_mean_kl_ours_vs_theirs"] = kl_between
    rows = []
    prompt = windows[0][:32]
    for label in ["ours f32", "llama.cpp f32", "ours f16", "llama.cpp f16", "llama.cpp q4_0", "ours GPTQ q4_0",
                  "llama.cpp q4_1", "ours AWQ q4_1", "llama.cpp q4_k_m"]:
        log(f"llama.cpp: {label}")
        r = LlamaRunner(files[label], args.seqlen, args.threads)
        ppl, kl, _ = score(r.logits, windows, ref_lp)
        tps = r.decode_tps(prompt, args.decode_steps, args.repeats)
        r.close()
        rows.append({"file": label, "mb": round(files[label].stat().st_size / 1e6, 1), "ppl": round(ppl, 3),
                     "kl_vs_f32": kl, "decode_tps": round(statistics.median(tps), 1),
                     "decode_tps_spread": [round(min(tps), 1), round(max(tps), 1)]})
    results["gguf"] = rows

    # --- 3. ONNX int4 ----------------------------------------------------------------------------
    from slmedge.export import onnx as ox
    from slmedge.backends.ort import OrtDecoder

    onnx_rows = []
    ours_dir = wd / "onnx-ours-gptq-int4"
    export_onnx(arts["gptq"], ours_dir, "int4", exact=True, overwrite=True)
    ours_awq_dir = wd / "onnx-ours-awq-int4"
    export_onnx(arts["awq"], ours_awq_dir, "int4", exact=True, overwrite=True)
    peer_dir = wd / "onnx-peer-int4-acc4"
    if not (peer_dir / "model.onnx").is_file():
        import onnx
        import shutil

        log("fp32 graph + onnxruntime MatMulNBitsQuantizer (RTN, block 32, symmetric)")
        stage = wd / "onnx-peer-stage"
        shutil.rmtree(stage, ignore_errors=True)
        export_onnx(hf_dir, stage, "fp32", overwrite=True, verify=False)
        model = onnx.load(str(stage / "model.onnx"))
        model = ox.ort_quantize_matmuls(model, 4, 32, True, 4)  # accuracy level 4, as ours
        peer_dir.mkdir(parents=True, exist_ok=True)
        onnx.save_model(model, str(peer_dir / "model.onnx"))
        shutil.rmtree(stage)
    fp32_dir = wd / "onnx-fp32"
    if not (fp32_dir / "model.onnx").is_file():
        export_onnx(hf_dir, fp32_dir, "fp32", overwrite=True, verify=False)
    onnx_ref = None
    for label, d in (("onnx fp32", fp32_dir), ("onnxruntime int4 RTN b32 (peer)", peer_dir),
                     ("ours GPTQ int4 (codes)", ours_dir), ("ours AWQ int4 (codes)", ours_awq_dir)):
        log(f"onnxruntime: {label}")
        dec = OrtDecoder(d, n_threads=args.threads)
        ppl, kl, lps = score(dec.logits, windows, onnx_ref)
        if onnx_ref is None:
            onnx_ref = lps
        # Decode latency: one token at a time through the KV cache after a 32-token prompt.
        lat = []
        for _ in range(args.repeats + 1):
            out, past = dec.run(np.asarray([prompt]))
            tokid = int(out[0, -1].argmax())
            t = time.perf_counter()
            for i in range(args.decode_steps):
                out, past = dec.run(np.asarray([[tokid]]), past, past_len=len(prompt) + i)
                tokid = int(out[0, -1].argmax())
            lat.append(1000 * (time.perf_counter() - t) / args.decode_steps)
        size = sum(p.stat().st_size for p in d.iterdir() if p.name.startswith("model.onnx"))
        onnx_rows.append({"file": label, "mb": round(size / 1e6, 1), "ppl": round(ppl, 3), "kl_vs_fp32": kl,
                          "decode_ms_per_token": round(statistics.median(lat[1:]), 2)})
    results["onnx"] = onnx_rows

    # --- print -----------------------------------------------------------------------------------
    print(f"\nSmolLM2-135M, {results['windows']}, {args.threads} threads\n")
    print("1. f32/f16 GGUF: ours vs llama.cpp convert_hf_to_gguf.py (same HF folder)")
    for t in ("f32", "f16"):
        c = conv[t]
        print(f"   {t}: tensors {c['tensors'][0]} vs {c['tensors'][1]}, same names {c['same_names']}, "
              f"type differs {c['type_differs'] or 'none'}, shape differs {c['shape_differs'] or 'none'}, "
              f"max |value diff| {c['max_abs_value_diff']:.3g}; time {c['ours_s']} s vs {c['theirs_s']} s")
    print(f"   f32 logits in llama.cpp, ours vs theirs (1 window): mean KL {kl_between:.2e}")
    print("\n2. GGUF in llama.cpp")
    print(f"   {'file':22} {'MB':>7} {'PPL':>9} {'KL vs f32':>10} {'decode tok/s':>13}")
    for r in rows:
        print(f"   {r['file']:22} {r['mb']:7.1f} {r['ppl']:9.3f} {r['kl_vs_f32']:10.4f} {r['decode_tps']:13.1f}")
    print("   (the base is SmolLM2's Q4_1 GGUF dequantized: llama.cpp's q4_1 re-finds that grid almost exactly)")
    print("\n3. ONNX in onnxruntime (MatMulNBits accuracy level 4)")
    print(f"   {'file':34} {'MB':>7} {'PPL':>9} {'KL vs fp32':>10} {'decode ms/tok':>14}")
    for r in onnx_rows:
        print(f"   {r['file']:34} {r['mb']:7.1f} {r['ppl']:9.3f} {r['kl_vs_fp32']:10.4f} {r['decode_ms_per_token']:14.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
