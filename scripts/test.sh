#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit tests on tiny random models and the
# end-to-end tests on the real SmolLM2-135M. Extra arguments go to pytest (e.g. -m "not e2e").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The emulated arm64 target (qemu + aarch64 Python, onnxruntime, llama.cpp), built once per machine.
.venv/bin/slmedge targets setup arm64 --if-needed || echo "note: arm64 target not set up; its tests skip" >&2
exec .venv/bin/python -m pytest -q "$@"
