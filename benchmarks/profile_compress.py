"""Where compress() spends its time: perf_counter wrappers around the engine's and the methods' functions.

    .venv/bin/python benchmarks/profile_compress.py gptq [--blocks N] [--cprofile] [--ppl] [--write DIR]
        [--bound-heap | --heap MMAP_MIB,TRIM_MIB]

No source is edited: the wrappers are installed at import. --blocks N keeps the first N decoder
blocks (per-block costs, quickly); --ppl adds WikiText-2 perplexity over 4 x 2048 tokens (not with
--write); --write DIR writes the artifact block by block (the path `slmedge compress` takes);
--bound-heap sets the glibc thresholds that path sets (engine._bound_heap), --heap others. Methods:
rtn, gptq, awq, wanda, sparsegpt, magnitude, with the benchmark's settings (32 x 512 C4 tokens).
"""
import sys, time, json, collections, functools
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from slmedge.compress import engine, blocks
from slmedge.compress.methods import base as mbase, gptq as mgptq, sparsegpt as msg, wanda as mw, awq as mawq
from slmedge.compress import quant
from slmedge.compress.api import compress
from slmedge.compress.recipe import Recipe

T = collections.defaultdict(float); N = collections.Counter()
def timed(label, fn):
    @functools.wraps(fn)
    def w(*a, **k):
        t = time.perf_counter()
        try: return fn(*a, **k)
        finally: T[label] += time.perf_counter() - t; N[label] += 1
    return w

engine.capture_inputs = timed("capture_inputs", engine.capture_inputs)
engine.collect_stats = timed("collect_stats (block fwd w/ hooks + stats)", engine.collect_stats)
engine.run_block = timed("run_block (all)", engine.run_block)
mbase.HessianStats.add_batch = timed("HessianStats.add_batch", mbase.HessianStats.add_batch)
mbase.InputNormStats.add_batch = timed("InputNormStats.add_batch", mbase.InputNormStats.add_batch)
mgptq.hinv_factor = timed("hinv_factor (damped Cholesky, inverse)", mgptq.hinv_factor)
mgptq.gptq_quantize = timed("gptq_quantize (total incl hinv)", mgptq.gptq_quantize)
msg.sparsegpt_prune = timed("sparsegpt_prune (total incl hinv)", msg.sparsegpt_prune)
mbase.quantize_groups = timed("quantize_groups (RTN)", mbase.quantize_groups)
engine._apply = timed("_apply (copy weight back)", engine._apply)
engine._compress_head = timed("_compress_head", engine._compress_head)
if True:
    mawq.clip_search = timed("awq clip_search", mawq.clip_search)
mawq.AWQ._search = timed("awq scale _search", mawq.AWQ._search)
mawq.run_block = timed("awq run_block (stats pass)", mawq.run_block)

import slmedge.compress.api as api
if "--blocks" in sys.argv:
    nblocks = int(sys.argv[sys.argv.index("--blocks") + 1])
    _cm = api.compress_model
    def cm(model, arch, *a, **k):
        layers = model.get_submodule(arch.layers)
        del layers[nblocks:]
        return _cm(model, arch, *a, **k)
    api.compress_model = cm
method = sys.argv[1]
kw = dict(gptq=dict(method="gptq", bits=4, group_size=64, symmetric=True),
          rtn=dict(method="rtn", bits=4, group_size=64),
          awq=dict(method="awq", bits=4, group_size=64),
          wanda=dict(method="wanda", bits=None, sparsity="0.5"),
          sparsegpt=dict(method="sparsegpt", bits=None, sparsity="0.5"),
          magnitude=dict(method="magnitude", bits=None, sparsity="0.5"))[method]
extra = json.loads(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].startswith("{") else {}
kw.update(extra)
prof = "--cprofile" in sys.argv
if "--bound-heap" in sys.argv:
    engine._bound_heap()
if "--heap" in sys.argv:  # --heap MMAP_MIB,TRIM_MIB: glibc thresholds set by hand (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD)
    mm, tr = (int(v) << 20 for v in sys.argv[sys.argv.index("--heap") + 1].split(","))
    engine._libc().mallopt(engine._M_MMAP_THRESHOLD, mm); engine._libc().mallopt(engine._M_TRIM_THRESHOLD, tr)
if prof:
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable()
t0 = time.perf_counter()
if "--write" in sys.argv:  # --write DIR: the artifact written block by block, as `slmedge compress` does
    out = compress(None, Recipe(nsamples=32, seqlen=512, **kw), sys.argv[sys.argv.index("--write") + 1], device="cpu")
else:
    out = compress(None, Recipe(nsamples=32, seqlen=512, **kw), write=False, device="cpu")
wall = time.perf_counter() - t0
if prof:
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(25)
print(method, "timings", out.result.timings, "wall", round(wall, 2))
for k, v in sorted(T.items(), key=lambda x: -x[1]):
    print(f"  {k:<45} {v:8.2f} s  calls {N[k]}")
if "--ppl" in sys.argv:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # compress_peers.py, beside this file
    from compress_peers import eval_ppl
    from slmedge.evaluate.corpora import load_corpus
    from slmedge.evaluate.perplexity import windows_of
    windows, _ = windows_of(out.loaded.tokenizer, load_corpus("wikitext2"), 2048, 4)
    print("ppl", eval_ppl(out.loaded.model, windows))
