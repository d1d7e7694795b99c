#!/bin/bash
# alternate old / new builds of gguf_linear.cpp in fresh processes: W2 latency then W1
M=/tmp/m/qwen3-0.6b-Q4_K_M.gguf/qwen3-0.6b-Q4_K_M.gguf
cd /work/main
for r in 1 2 3; do
  for v in old new; do
    if [ $v = old ]; then cp /tmp/kb/old.cpp pagedllm/kernels/csrc/gguf_linear.cpp; else cp /tmp/kb/new.cpp pagedllm/kernels/csrc/gguf_linear.cpp; fi
    .venv/bin/pagedllm bench latency --threads 2 --model $M --output-len 128 --output-json /tmp/kb/ab-lat-$v-$r.json 2>&1 | grep "^latency" | awk -v v=$v -v r=$r '{print "W2", v, r, "TTFT", $(NF-8), "decode", $(NF-7)}'
  done
done
for r in 1 2; do
  for v in old new; do
    if [ $v = old ]; then cp /tmp/kb/old.cpp pagedllm/kernels/csrc/gguf_linear.cpp; else cp /tmp/kb/new.cpp pagedllm/kernels/csrc/gguf_linear.cpp; fi
    .venv/bin/pagedllm bench throughput --threads 2 --model $M --num-prompts 32 --output-json /tmp/kb/ab-w1-$v-$r.json 2>&1 | grep "^throughput" | awk -v v=$v -v r=$r '{print "W1", v, r, "out tok/s", $(NF-11)}'
  done
done
cp /tmp/kb/old.cpp pagedllm/kernels/csrc/gguf_linear.cpp
