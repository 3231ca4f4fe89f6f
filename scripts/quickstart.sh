#!/usr/bin/env bash
# On a fresh machine: set everything up and run the main job on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0
.venv/bin/slmedge run "$@" || status=$?
# The README's next commands call slmedge by name: it is on PATH once the virtualenv is active.
echo "to type slmedge commands in this shell: source .venv/bin/activate"
exit "$status"
