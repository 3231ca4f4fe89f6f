#!/usr/bin/env bash
# On a fresh machine: set everything up and run the main job on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/slmedge run "$@"
