#!/usr/bin/env bash
# Create (idempotently) the virtualenvs of the compressed-tensors readers that slmedge's
# compressed-tensors export is checked against (tests/test_ct_readers.py runs each in a subprocess):
#   ct-0.17.0  compressed-tensors 0.17.0 + transformers 5.20.x  (vLLM 0.33's pins)
#   ct-0.19.0  compressed-tensors 0.19.0 + transformers 5.17.x  (llm-compressor 0.14.0.1's pins)
# Each gets torch 2.13.0 (the CPU build; pip finds it in its wheel cache or the machine's wheel folder),
# accelerate and safetensors, nothing of slmedge. A venv is complete only when its `ready` file exists
# (written last, with the versions installed); an interrupted run is finished by the next one.
#   CT_READERS_DIR  where the venvs go (default .bench/ct-readers in the repository root)
#   CT_READERS      which readers to make (default "0.17.0 0.19.0")
#   CT_TORCH        torch requirement installed first (default torch==2.13.0)
# pip's cache stays on: a second machine-wide run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

ROOT=${CT_READERS_DIR:-.bench/ct-readers}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

transformers_for() {  # the transformers range each reader's tool pins
  case "$1" in
    0.17.0) echo "transformers>=5.20,<5.21" ;;  # vLLM 0.33.0: >=5.16.1,<5.21
    0.19.0) echo "transformers>=5.17,<5.18" ;;  # llm-compressor 0.14.0.1: >=5.15,<=5.17
    *) echo "transformers>=5.3" ;;
  esac
}

for version in ${CT_READERS:-0.17.0 0.19.0}; do
  venv=$ROOT/ct-$version
  if [ -f "$venv/ready" ]; then
    echo "compressed-tensors reader $version: $(cat "$venv/ready") (already made)"
    continue
  fi
  started=$(date +%s)
  rm -rf "$venv"  # an unfinished venv (no ready file) from an interrupted run: only this script writes here
  mkdir -p "$ROOT"
  "$PYTHON" -m venv "$venv"
  vpy=$venv/bin/python
  "$vpy" -m pip install -q --upgrade pip
  # torch first, pinned, so that the ranges below keep this build instead of pulling another one.
  "$vpy" -m pip install -q "${CT_TORCH:-torch==2.13.0}"
  "$vpy" -m pip install -q "compressed-tensors==$version" "$(transformers_for "$version")" "accelerate>=1.0" \
    "safetensors>=0.4" "numpy"
  versions=$("$vpy" - <<'PY'
from importlib.metadata import version
print(" | ".join(f"{p} {version(p)}" for p in ("compressed-tensors", "transformers", "torch")))
PY
)
  echo "$versions" > "$venv/ready.tmp" && mv "$venv/ready.tmp" "$venv/ready"
  echo "compressed-tensors reader $version: $versions (made in $(( $(date +%s) - started )) s)"
done
