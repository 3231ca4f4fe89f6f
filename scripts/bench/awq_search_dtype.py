"""AWQ's scale search in bf16 against fp32, mapping by mapping, on SmolLM2 (the embedded default).

    .venv/bin/python scripts/bench/awq_search_dtype.py [--blocks N] [--group-size G] [--out FILE.json]

Compresses with AWQ W4 g64 (or ``--group-size G``; 32 x 512 C4 tokens, the benchmark's settings) along fp32's path: at each
mapping the 20 grid losses are taken both with fp32 and with bf16 linears and attention
(``methods.awq.grid_losses``) and fp32's choice is applied. Prints how many mappings bf16 would
choose otherwise, how far above fp32's best loss its choices are, and the two searches' seconds.
"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch
from slmedge.compress.methods import awq as mawq
import slmedge.compress.api as api
from slmedge.compress.recipe import Recipe

RECORDS = []
SECONDS = {"float32": 0.0, "bfloat16": 0.0}


def both(self, module, calls, linears, x_mean, spec, n_grid, dtype=torch.float32):
    rec = {"module": type(module).__name__}
    for dt in (torch.float32, torch.bfloat16):
        name = str(dt).removeprefix("torch.")
        t = time.perf_counter()
        rec[name], scales = mawq.grid_losses(module, calls, linears, x_mean, spec, n_grid, dt)
        SECONDS[name] += time.perf_counter() - t
    RECORDS.append(rec)
    f = rec["float32"]
    return scales[min(range(n_grid), key=f.__getitem__)]


mawq.AWQ._search = both
if "--blocks" in sys.argv:
    nblocks = int(sys.argv[sys.argv.index("--blocks") + 1])
    _cm = api.compress_model

    def cm(model, arch, *a, **k):
        del model.get_submodule(arch.layers)[nblocks:]
        return _cm(model, arch, *a, **k)
    api.compress_model = cm
group = int(sys.argv[sys.argv.index("--group-size") + 1]) if "--group-size" in sys.argv else 64
api.compress(None, Recipe(method="awq", bits=4, group_size=group, nsamples=32, seqlen=512), write=False, device="cpu")
differ = []
for r in RECORDS:
    f, b = r["float32"], r["bfloat16"]
    i, j = min(range(len(f)), key=f.__getitem__), min(range(len(b)), key=b.__getitem__)
    r["choice"] = [i, j]
    if i != j:
        differ.append((r["module"], i, j, f[j] / f[i] - 1))
print(f"mappings {len(RECORDS)}; bf16 chooses another grid point in {len(differ)}")
for mod, i, j, excess in differ:
    print(f"  {mod}: fp32 a={i}, bf16 a={j}: fp32 loss +{100 * excess:.3f}%")
# The method's rule (AWQ._search): fp32 decides among the points near bf16's best (REFINE_MARGIN, REFINE_NOISE).
same, cands = 0, []
for r in RECORDS:
    f, b = r["float32"], r["bfloat16"]
    jb = min(range(len(b)), key=b.__getitem__)
    margin = max(mawq.REFINE_MARGIN, mawq.REFINE_NOISE * abs(b[jb] / f[jb] - 1))
    pts = [i for i, x in enumerate(b) if x <= b[jb] * (1 + margin)]
    cands.append(len(pts))
    same += min(pts, key=f.__getitem__) == min(range(len(f)), key=f.__getitem__)
print(f"with the refinement (margin max({mawq.REFINE_MARGIN:.0%}, {mawq.REFINE_NOISE:g} r)): fp32's grid point in {same} of {len(RECORDS)} mappings; "
      f"fp32 forwards per mapping {1 + sum(cands) / len(cands):.2f} (mean), {1 + max(cands)} (max), against {1 + len(RECORDS[0]['float32'])}")
rel = [abs(b / a - 1) for r in RECORDS for a, b in zip(r["float32"], r["bfloat16"])]
print(f"bf16 loss vs fp32 loss, all grid points: median {100 * sorted(rel)[len(rel) // 2]:.3f}%, max {100 * max(rel):.3f}%")
print("search seconds", {k: round(v, 1) for k, v in SECONDS.items()})
if "--out" in sys.argv:
    Path(sys.argv[sys.argv.index("--out") + 1]).write_text(json.dumps(RECORDS))
