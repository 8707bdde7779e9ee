#!/usr/bin/env bash
# The one test command (README, .ci/run): set up, then run the Rust core tests and the Python suite.
# Real-model checks marked `smoke_model` run here in a small form; `slow_model` and `bench` are opt-in.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo test --release -p depthgate-core
# Every import points down the pipeline (contracts in pyproject.toml [tool.importlinter]).
.venv/bin/lint-imports
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
