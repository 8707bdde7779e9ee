#!/usr/bin/env bash
# Serve the converted embedded model with the real vLLM (CPU) on 127.0.0.1:${PORT:-8011}, as
# matrices/vllm-cpu.toml expects: `bash scripts/vllm_serve.sh` (after scripts/setup_vllm.sh).
# Ready in ≈ 2 min on 2 cores; ≈ 8 GB resident over its 3 processes; Ctrl-C (SIGTERM) stops them all.
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} HF_HUB_OFFLINE=1
exec .venv-vllm/bin/python scripts/vllm/serve.py serve models/gemma3-270m-hf \
  --host 127.0.0.1 --port "${PORT:-8011}" --served-model-name gemma3-270m-hf \
  --max-model-len 2048 --dtype bfloat16 --enforce-eager "$@"
