#!/usr/bin/env bash
# The serving sweep against the peers' servers, in one run: Poisson 2, 4 and 8 req/s and
# concurrency 1, 4 and 16 over random 128 in / 128 out (64 prompts, EOS ignored), against
# `tokenworks serve`, vLLM's CPU server and llama-server (16 slots each), one after another
# (they share the 2 cores), each driven by vLLM's own client (`vllm bench serve`) and by
# ours. Then our server with 2 replicas of 1 thread against 1 engine of 2 threads, and
# prefix-aware against round-robin routing on a shared-prefix workload.
# Peers from benchmarks/peers.sh; a peer that does not start leaves no record.
set -uo pipefail
cd "$(dirname "$0")/.."
TW=${TW:-.venv/bin/tokenworks}
PEERS=${PEERS:-peers}
OUT=${OUT:-benchmarks/results}
HF="$PEERS/smol-hf"
GGUF=$(.venv/bin/python -c "from tokenworks.models import catalogue; print(catalogue.pull('smollm2-135m'))")
PORT=8100
URL=http://127.0.0.1:$PORT
SWEEP=(--num-prompts 64 --input-tokens 128 --output-tokens 128 --seed 0
       --request-rate 2,4,8 --max-concurrency 1,4,16 --warmup-requests 4)

up() {  # wait for a server's /v1/models
  for _ in $(seq 300); do curl -sf "$URL/v1/models" >/dev/null && return 0; sleep 1; done
  return 1
}

both_clients() {  # LABEL: the sweep with vLLM's client, then with ours
  if [ -x "$PEERS/vllm/bin/python" ]; then
    $TW bench serve --base-url "$URL" --served-model smollm2-135m --label "$1" \
      --client vllm --client-python "$PEERS/vllm/bin/python" --tokenizer "$HF" \
      "${SWEEP[@]}" --out "$OUT"
  fi
  $TW bench serve --base-url "$URL" --served-model smollm2-135m --label "$1" \
    "${SWEEP[@]}" --out "$OUT"
}

stop() { kill -INT "$1" 2>/dev/null; wait "$1" 2>/dev/null; sleep 2; }

# ours: the engine core in its own process (the default), bfloat16, 2 threads
$TW serve --threads 2 --max-num-seqs 16 --port $PORT --log-level warning > /tmp/serve-ours.log 2>&1 &
PID=$!; up && both_clients "tokenworks (bf16)"; stop $PID

# vLLM's CPU build on the bfloat16 HF copy of the same weights
if [ -x "$PEERS/vllm/bin/python" ] && [ -d "$HF" ]; then
  LD_PRELOAD="$PEERS/vllm/lib/libiomp5.so" VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 \
    "$PEERS/vllm/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF" \
    --served-model-name smollm2-135m --dtype bfloat16 --host 127.0.0.1 --port $PORT \
    --max-num-seqs 16 > /tmp/serve-vllm.log 2>&1 &
  PID=$!; up && both_clients "vLLM CPU (bf16)"; stop $PID
fi

# llama.cpp's server on the Q4_1 GGUF, 16 slots sharing the context
if [ -x "$PEERS/llamacpp/bin/llama-server" ]; then
  "$PEERS/llamacpp/bin/llama-server" -m "$GGUF" --alias smollm2-135m --host 127.0.0.1 \
    --port $PORT -np 16 -c 8192 -t 2 -tb 2 --no-webui > /tmp/serve-llama.log 2>&1 &
  PID=$!; up && both_clients "llama.cpp server (Q4_1)"; stop $PID
fi

# 2 replicas x 1 thread against 1 engine x 2 threads (our client, closed-loop points)
REPL=(--num-prompts 64 --input-tokens 128 --output-tokens 128 --seed 0
      --max-concurrency 1,4,16 --warmup-requests 4)
for setup in "1x2:--threads 2" "2x1:--threads 1 --data-parallel-size 2"; do
  name=${setup%%:*}; args=${setup#*:}
  # shellcheck disable=SC2086
  $TW serve $args --max-num-seqs 16 --port $PORT --log-level warning > "/tmp/serve-$name.log" 2>&1 &
  PID=$!; up && $TW bench serve --base-url "$URL" --served-model smollm2-135m \
    --label "tokenworks $name" "${REPL[@]}" --out "$OUT"; stop $PID
done

# prefix-aware against round-robin routing: 2 replicas, 16 groups of prompts sharing a
# 512-token prefix
SHARED=$(mktemp --suffix .json)
cat > "$SHARED" <<'JSON'
{"kind": "shared_prefix", "num_requests": 64, "seed": 0, "groups": 16, "prefix_len": 512,
 "input": {"dist": "fixed", "value": 32}, "output": {"dist": "fixed", "value": 32},
 "ignore_eos": true}
JSON
for router in prefix round_robin; do
  $TW serve --threads 1 --data-parallel-size 2 --router $router --max-num-seqs 16 \
    --port $PORT --log-level warning > "/tmp/serve-$router.log" 2>&1 &
  PID=$!; up && $TW bench serve --base-url "$URL" --served-model smollm2-135m \
    --label "tokenworks 2x1, router $router" --manifest "$SHARED" --max-concurrency 4 \
    --warmup-requests 0 --out "$OUT"; stop $PID
done
echo "report: $TW bench report $OUT/serving-*.json --out benchmarks/report"
