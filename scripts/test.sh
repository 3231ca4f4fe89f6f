#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit tests on tiny random models and the
# end-to-end tests on the real SmolLM2-135M. Extra arguments go to pytest (e.g. -m "not e2e").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
