#!/usr/bin/env bash
# The main job on the embedded default: set up, then run matrices/smoke.toml end to end on a real
# model (llama.cpp in process, Gemma-3-270M on CPU) and print where the report is.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/depthgate run matrices/smoke.toml --out runs/smoke "$@"
