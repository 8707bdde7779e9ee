#!/usr/bin/env bash
# Nightly long-context position gate from cron on a GPU box (the CI-free variant of nightly-gpu.yml;
# explained in docs/nightly.md). Example crontab line (01:00 every night):
#
#   0 1 * * * cd /opt/depthgate && bash docs/examples/nightly-cron.sh >> /var/log/depthgate-nightly.log 2>&1
#
# Assumes the checkout has .venv (depthgate installed: `python -m venv .venv && .venv/bin/pip install .`)
# and .venv-vllm (`pip install vllm==$VLLM_VERSION`), and the served model in the Hugging Face cache
# (vLLM and depthgate read the same snapshot: tokenizer = "hf:…" in the matrix). Starts vLLM on 127.0.0.1, runs
# `depthgate run matrices/nightly.toml --out runs/$DATE`, resumes once on exit 30 or 11, keeps the
# report under $REPORT_ROOT/$DATE, and exits with depthgate's code (0 PASS, 10 FAIL, 11 INCONCLUSIVE,
# 12 SAFETY, 13 FAIL_SYSTEM, 20 BAD_INPUT, 21 VERIFY_FAILED, 22 TOKENIZER_MISMATCH, 30 INFRA). $NOTIFY_CMD, if set, is run with the verdict,
# the exit code and the report folder as arguments (e.g. a script that posts to your chat).
set -uo pipefail

cd "$(dirname "$0")/../.." || exit 30   # the repository root

MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct-1M}          # = baseline.model in matrices/nightly.toml
CANDIDATE_ADAPTER=${CANDIDATE_ADAPTER:?set CANDIDATE_ADAPTER to the LoRA adapter served as nightly-candidate}
VLLM_PORT=${VLLM_PORT:-8000}                         # = the endpoint in matrices/nightly.toml
MAX_MODEL_LEN=${MAX_MODEL_LEN:-139264}               # >= 131072 + max_tokens; = window in the matrix
CONCURRENCY=${CONCURRENCY:-16}
MATRIX=${MATRIX:-matrices/nightly.toml}
REPORT_ROOT=${REPORT_ROOT:-reports/nightly}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-1800}
NOTIFY_CMD=${NOTIFY_CMD:-}

DATE=$(date -u +%F)                     # one folder per night: a rerun the same night resumes
OUT="runs/${DATE}"
LOGS="logs/${DATE}"
mkdir -p "$LOGS" "$REPORT_ROOT"

# One night at a time: a run that outlives 24 h is not joined by the next one.
exec 9> .depthgate-nightly.lock
if ! flock -n 9; then
  echo "$(date -u +%FT%TZ) another nightly run holds .depthgate-nightly.lock; skipping"
  exit 0
fi

log() { echo "$(date -u +%FT%TZ) $*"; }

notify() {  # verdict code
  if [ -n "$NOTIFY_CMD" ]; then
    $NOTIFY_CMD "$1" "$2" "$REPORT_ROOT/$DATE" || log "notify command failed"
  fi
}

VLLM_PID=""
# shellcheck disable=SC2317  # invoked by the EXIT trap
stop_server() {
  if [ -n "$VLLM_PID" ] && kill -0 "$VLLM_PID" 2>/dev/null; then
    log "stopping vLLM (pid $VLLM_PID)"
    kill "$VLLM_PID"
    for _ in $(seq 1 60); do kill -0 "$VLLM_PID" 2>/dev/null || break; sleep 1; done
    kill -9 "$VLLM_PID" 2>/dev/null || true
  fi
}
trap stop_server EXIT

# ---- start the server and wait until it answers /v1/models --------------------------------------
log "starting vLLM $MODEL on 127.0.0.1:$VLLM_PORT (candidate adapter: $CANDIDATE_ADAPTER)"
.venv-vllm/bin/vllm serve "$MODEL" --host 127.0.0.1 --port "$VLLM_PORT" \
  --max-model-len "$MAX_MODEL_LEN" --seed 0 \
  --enable-lora --max-lora-rank 64 --lora-modules "nightly-candidate=$CANDIDATE_ADAPTER" \
  > "$LOGS/vllm.log" 2>&1 &
VLLM_PID=$!

deadline=$(( $(date +%s) + READY_TIMEOUT_S ))
until curl -fsS "http://127.0.0.1:$VLLM_PORT/v1/models" > "$LOGS/models.json" 2>/dev/null; do
  if ! kill -0 "$VLLM_PID" 2>/dev/null; then
    log "vLLM exited during start-up; last lines of $LOGS/vllm.log:"; tail -50 "$LOGS/vllm.log"
    notify INFRA 30; exit 30
  fi
  if [ "$(date +%s)" -ge "$deadline" ]; then
    log "vLLM not ready after ${READY_TIMEOUT_S}s"; tail -50 "$LOGS/vllm.log"
    notify INFRA 30; exit 30
  fi
  sleep 5
done
log "vLLM ready: $(cat "$LOGS/models.json")"

# ---- run (resume once on infrastructure trouble or an INCONCLUSIVE verdict) --------------------
run_once() {
  .venv/bin/depthgate run "$MATRIX" --out "$OUT" --concurrency "$CONCURRENCY" --progress
}
run_once; code=$?
if [ "$code" -eq 30 ] || [ "$code" -eq 11 ]; then
  # Only unfinished and infra_error jobs are re-sent; finished records are read from $OUT.
  log "exit $code; resuming $OUT once"
  run_once; code=$?
fi

case "$code" in
  0)  verdict=PASS ;;
  10) verdict=FAIL ;;
  11) verdict=INCONCLUSIVE ;;
  12) verdict=SAFETY ;;
  20) verdict=BAD_INPUT ;;
  21) verdict=VERIFY_FAILED ;;
  30) verdict=INFRA ;;
  *)  verdict="ERROR_$code" ;;
esac

# ---- keep the report (verdict.json, summary.md, junit.xml, report.html, heatmaps) ---------------
if [ -d "$OUT/report" ]; then
  rm -rf "${REPORT_ROOT:?}/$DATE"
  cp -r "$OUT/report" "$REPORT_ROOT/$DATE"
  cp "$OUT/manifest.json" "$REPORT_ROOT/$DATE/" 2>/dev/null || true
fi
cp "$LOGS/vllm.log" "$REPORT_ROOT/$DATE.vllm.log" 2>/dev/null || true

case "$code" in
  0)  log "PASS: every length x depth slice is non-inferior" ;;
  10) log "FAIL: a slice regressed or non-inferiority was not shown; see $REPORT_ROOT/$DATE/summary.md" ;;
  11) log "INCONCLUSIVE after one resume: too few valid cases, > 10 % missing or unpaired seeds" ;;
  12) log "SAFETY: a forbidden safety claim was answered; blocks pending human review" ;;
  20) log "BAD_INPUT: fix the matrix, tokenizer files or plan (the message above names file, field, fix)" ;;
  21) log "VERIFY_FAILED: a layout broke the token-exact contract" ;;
  30) log "INFRA: the server failed twice; not a model verdict ($LOGS/vllm.log)" ;;
  *)  log "unexpected exit $code" ;;
esac
notify "$verdict" "$code"
exit "$code"
