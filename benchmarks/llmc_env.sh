#!/usr/bin/env bash
# Create (idempotently) a separate virtualenv for llm-compressor, the reference implementation the
# benchmark compares slmedge against. It needs transformers 5.x, so it cannot share slmedge's .venv.
#   LLMC_VENV      venv path, relative to the repository root (default .bench/llmc-venv)
#   LLMC_SPEC      llmcompressor requirement (default the tested pin below)
#   LLMC_TORCH     torch requirement installed first (default torch==2.13.0, the local CPU build)
# pip's cache stays on. Prints the installed llmcompressor / torch / transformers versions.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${LLMC_VENV:-.bench/llmc-venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
fi
VPY=$VENV/bin/python
"$VPY" -m pip install -q --upgrade pip

# torch first, pinned, so that llmcompressor's range keeps this build instead of pulling another one.
"$VPY" -m pip install -q "${LLMC_TORCH:-torch==2.13.0}"
"$VPY" -m pip install -q "${LLMC_SPEC:-llmcompressor==0.14.0.1}"
"$VPY" - <<'PY'
from importlib.metadata import version
print("llmcompressor", version("llmcompressor"), "| torch", version("torch"),
      "| transformers", version("transformers"))
PY
