#!/bin/bash
# W1 on Qwen3-0.6B Q4_K_M: pagedllm + llama-server, int8/q8_0 KV then bf16/f16 KV, twice alternating
cd /work/main
M=/tmp/m/qwen3-0.6b-Q4_K_M.gguf
for round in 1 2; do
  for kv in int8 auto; do
    .venv/bin/pagedllm bench throughput --model $M --threads 2 --compare llamacpp --llama-gguf $M \
      --kv-cache-dtype $kv --output-json /tmp/kv8/w1-qwen3-$kv-$round.json > /tmp/kv8/w1-qwen3-$kv-$round.log 2>&1
  done
done
