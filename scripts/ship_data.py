"""Copy the data slmedge's defaults need into the package and (re)write its index.

    python scripts/ship_data.py SOURCE_DIR     # a folder with calibration/, perplexity/, tasks/
    python scripts/ship_data.py                # re-index what is already in slmedge/data/shipped

The index (`slmedge/data/shipped/datasets.json`) records, for every data set, what it is, its
licence and where it came from (repository and commit), and for every file its size, item count
and sha256. `slmedge data verify` and every read of a shipped file check against it. The
provenance table below is the one maintained by hand; the numbers are computed from the files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent.parent / "slmedge" / "data" / "shipped"

FOUNDRY = {"repository": "mosaicml/llm-foundry", "commit": "8c8dd48", "path": "scripts/eval/local_data"}

# name: (what, files (globs under the data folder), licence as the source states it, source)
SETS = {
    "c4": ("calibration: the first 1,000 documents of C4 (en), train shard 00000", ["calibration/c4_en.jsonl"],
           "ODC-BY", {"repository": "Diffusion-bachelor/diffusion-data-constraint-rare-events", "commit": "3305ae8",
                      "note": "a copy of the C4 shard's head"}),
    "multilingual": ("calibration: news and TICO-19 sentences in en ar hi zh de es fr ru (not overlapping the "
                     "perplexity corpora)", ["calibration/multilingual/*.txt"], "TICO-19 CC0; WMT research use",
                     {"repository": "Helsinki-NLP/OPUS-MT-testsets", "commit": "ac0f19c",
                      "note": "TICO-19 test, WMT newstest 2013"}),
    "wikitext2": ("perplexity: WikiText-2 raw test split (non-empty lines)", ["perplexity/wikitext2/test.txt"],
                  "CC BY-SA 3.0 / GFDL", {"repository": "Tylogi/TyloQuant", "commit": "7989d03",
                                          "note": "a copy; sha256 4f3e427e…103c of the original file"}),
    "ntrex128": ("perplexity: NTREX-128, the same 1,997 news sentences in 14 languages, line-aligned",
                 ["perplexity/ntrex128/*.txt"], "CC BY-SA 4.0",
                 {"repository": "MicrosoftTranslator/NTREX", "commit": "8561f6a"}),
    "arc_easy": ("task: ARC-Easy test (multiple choice)", ["tasks/arc_easy.jsonl"], "CC BY-SA 4.0", FOUNDRY),
    "arc_challenge": ("task: ARC-Challenge test (multiple choice)", ["tasks/arc_challenge.jsonl"], "CC BY-SA 4.0",
                      FOUNDRY),
    "boolq": ("task: BoolQ validation (multiple choice)", ["tasks/boolq.jsonl"], "CC BY-SA 3.0", FOUNDRY),
    "hellaswag": ("task: HellaSwag, 1,000 of the 10,042 validation items (lm-eval's preprocessing)",
                  ["tasks/hellaswag.jsonl"], "MIT", {"repository": "RubriksCube/rubriks_cube", "commit": "45e617d",
                                                     "note": "a copy"}),
    "openbookqa": ("task: OpenBookQA test (multiple choice)", ["tasks/openbookqa.jsonl"], "Apache-2.0", FOUNDRY),
    "piqa": ("task: PIQA validation (multiple choice)", ["tasks/piqa.jsonl"], "AFL-3.0", FOUNDRY),
    "winogrande": ("task: WinoGrande dev (schema: partial scoring)", ["tasks/winogrande.jsonl"], "CC BY", FOUNDRY),
    "copa": ("task: COPA validation (multiple choice)", ["tasks/copa.jsonl"], "BSD-2-Clause", FOUNDRY),
    "xcopa": ("task: XCOPA test, 500 items in each of 11 languages (lm-eval's connectives)",
              ["tasks/xcopa/*.jsonl"], "CC BY 4.0", {"repository": "cambridgeltl/xcopa", "commit": "e2e9d7f"}),
}


def count_items(path: Path) -> int:
    """Records of a .jsonl file, non-empty lines of a text file."""
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", nargs="?", type=Path, help="folder of the same layout to copy from")
    args = ap.parse_args()
    if args.source is not None:
        for sub in ("calibration", "perplexity", "tasks"):
            if not (args.source / sub).is_dir():
                print(f"error: {args.source} has no {sub}/", file=sys.stderr)
                return 1
    index = {"version": 1, "sets": {}}
    for name, (what, globs, licence, source) in SETS.items():
        files = {}
        for pattern in globs:
            origin = args.source if args.source is not None else SHIPPED
            matches = sorted(origin.glob(pattern))
            if not matches:
                print(f"error: nothing matches {pattern} under {origin}", file=sys.stderr)
                return 1
            for src in matches:
                rel = src.relative_to(origin).as_posix()
                dest = SHIPPED / rel
                if args.source is not None:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, dest)
                data = dest.read_bytes()
                if len(data) > 5_000_000:
                    print(f"error: {rel} is {len(data) / 1e6:.1f} MB; shipped files stay under 5 MB", file=sys.stderr)
                    return 1
                files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                              "items": count_items(dest)}
        index["sets"][name] = {"what": what, "licence": licence, "source": source, "files": files}
    out = SHIPPED / "datasets.json"
    out.write_text(json.dumps(index, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    n = sum(len(s["files"]) for s in index["sets"].values())
    size = sum(f["bytes"] for s in index["sets"].values() for f in s["files"].values())
    print(f"{out}: {len(index['sets'])} sets, {n} files, {size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
