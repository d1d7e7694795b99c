#!/bin/bash
# Issue 25's matrix: decode and time to first token against llama-bench (3 alternating
# rounds), W1 against llama-server, for each GGUF file given. Run from the repository root:
#   bash docs/benchmarks/xeon-amx-2026-11-29c/run.sh OUT_DIR FILE.gguf...
# (2026-11-29: qwen3-0.6b-Q4_K_M, qwen3-0.6b-Q8_0, llama-3.2-1b-Q8_0, llama-3.2-1b-Q4_K_M)
out=$1; shift
mkdir -p "$out"
B=".venv/bin/pagedllm bench"
for f in "$@"; do
  n=$(basename "$f" .gguf)
  echo "=== $n latency $(date)"
  $B latency --model "$f" --threads 2 --compare llamabench --llama-no-repack --latency-rounds 3 --output-len 64 \
     --output-json "$out/lat-$n.json" --output-png "$out/lat-$n.png" > "$out/lat-$n.log" 2>&1
  grep -E "^latency|^note" "$out/lat-$n.log"
  echo "=== $n W1 $(date)"
  $B throughput --model "$f" --threads 2 --compare llamacpp --llama-gguf "$f" --llama-no-repack --num-prompts 32 \
     --output-json "$out/w1-$n.json" --output-png "$out/w1-$n.png" > "$out/w1-$n.log" 2>&1
  grep -E "^throughput" "$out/w1-$n.log"
done
