#!/bin/bash
# W2 at a 2,048-token prompt on Qwen3-0.6B Q4_K_M: pagedllm + llama-bench, 8-bit then 16-bit KV, twice alternating
cd /work/main
M=/tmp/m/qwen3-0.6b-Q4_K_M.gguf
for round in 1 2; do
  for kv in int8 auto; do
    .venv/bin/pagedllm bench latency --model $M --threads 2 --compare llamabench --llama-gguf $M \
      --input-len 2048 --output-len 64 --latency-iters 2 \
      --kv-cache-dtype $kv --output-json /tmp/kv8/w2-qwen3-$kv-$round.json > /tmp/kv8/w2-qwen3-$kv-$round.log 2>&1
  done
done
