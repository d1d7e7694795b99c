#!/bin/bash
# Xeon matrix for issue 25: decode/TTFT vs llama-bench, W1 vs llama-server, four files
cd /work/main
B=".venv/bin/pagedllm bench"
for f in /tmp/m/qwen3-0.6b-Q4_K_M.gguf /tmp/m/q8/qwen3-0.6b-Q8_0.gguf /tmp/m/llama-3.2-1b-Q8_0.gguf /tmp/m/llama-3.2-1b-Q4_K_M.gguf; do
  n=$(basename $f .gguf)
  echo "=== $n latency $(date)"
  $B latency --model $f --threads 2 --compare llamabench --llama-no-repack --latency-rounds 3 --output-len 64 \
     --output-json /tmp/xm/lat-$n.json --output-png /tmp/xm/lat-$n.png > /tmp/xm/lat-$n.log 2>&1
  grep -E "^latency|llama" /tmp/xm/lat-$n.log | grep -v INFO | tail -4
  echo "=== $n W1 $(date)"
  $B throughput --model $f --threads 2 --compare llamacpp --llama-gguf $f --llama-no-repack --num-prompts 32 \
     --output-json /tmp/xm/w1-$n.json --output-png /tmp/xm/w1-$n.png > /tmp/xm/w1-$n.log 2>&1
  grep -E "^throughput" /tmp/xm/w1-$n.log | tail -3
done
echo "=== done $(date)"
