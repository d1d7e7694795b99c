#!/usr/bin/env bash
# Issue 24's W1 on the AMX Xeon: each family's real shape against HF transformers in the same run.
cd /work/main
for p in qwen2.5-0.5b gemma-3-1b phi-4-mini-8layers mistral-7b-8layers qwen3-30b-a3b-4layers mixtral-8x7b-2layers; do
  echo "== $p $(date -u +%H:%M:%S)"
  .venv/bin/pagedllm bench throughput --model /tmp/fam/$p --threads 2 --compare hf --hf-batch-sizes 32 \
    --output-json /tmp/famout/$p-w1.json > /tmp/famout/$p-w1.log 2>&1 || echo "FAILED $p"
  tail -6 /tmp/famout/$p-w1.log
done
echo "== done $(date -u +%H:%M:%S)"
