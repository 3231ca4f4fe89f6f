#!/usr/bin/env python
"""GPU check for the ``cuda`` target, for a machine with an NVIDIA GPU (CI has none; the tests
that need one skip). Prints and writes JSON: what ``slmedge targets check cuda`` finds, the
GPU's measured bandwidth and fp32 compute (the cuda profile's roofline), and a tiny random
llama evaluated on the GPU against the CPU (perplexity must agree; latency with its roofline).

    python scripts/gpu_check.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    from slmedge.targets.profiles import get_profile, profile_dict
    from slmedge.targets.transports import transport_for

    prof = get_profile("cuda")
    report["profile"] = profile_dict(prof)
    report["checks"] = [c.__dict__ for c in transport_for(prof).checks()]
    print(json.dumps(report["checks"], indent=1))
    import torch

    if torch.cuda.is_available():
        from tiny import save_tiny

        from slmedge.evaluate.api import EvalSettings, evaluate

        with tempfile.TemporaryDirectory() as tmp:
            model = save_tiny("llama", Path(tmp) / "llama")
            corpus = Path(tmp) / "c.txt"
            corpus.write_text("The quick brown fox jumps over the lazy dog. " * 40)
            s = dict(metrics=("perplexity", "latency"), langs=(), wikitext=False, corpora=(str(corpus),), seqlen=64,
                     ppl_windows=4, pp=64, tg=32, repeats=3)
            for target in ("cpu", "cuda"):
                res = evaluate(str(model), EvalSettings(**s, target=target))
                report[target] = {"perplexity": res["metrics"]["perplexity"]["c.txt"]["perplexity"],
                                  "latency": res["metrics"]["latency"]}
                print(target, json.dumps(report[target], default=str)[:600])
        report["ppl_rel_diff"] = abs(report["cuda"]["perplexity"] / report["cpu"]["perplexity"] - 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
