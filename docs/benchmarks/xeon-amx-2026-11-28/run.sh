#!/bin/bash
# alternate old rule (oneDNN + plain weights on AMX) and new (packed AMX), W1 then W2
M=${1:-/tmp/fam/qwen2.5-0.5b}; tag=${2:-q25}
cd /work/main
for r in 1 2; do
  for mode in old new; do
    .venv/bin/python /tmp/abrun.py $mode bench throughput --model $M --threads 2 --output-json /tmp/ab/$tag-w1-$mode-$r.json > /tmp/ab/$tag-w1-$mode-$r.log 2>&1
    grep "^throughput  pagedllm" /tmp/ab/$tag-w1-$mode-$r.log | awk -v m=$mode -v r=$r '{print "W1", m, r, $5, $10}'
  done
done
for r in 1 2; do
  for mode in old new; do
    .venv/bin/python /tmp/abrun.py $mode bench latency --model $M --threads 2 --output-len 64 --output-json /tmp/ab/$tag-w2-$mode-$r.json > /tmp/ab/$tag-w2-$mode-$r.log 2>&1
    grep "^latency  *pagedllm" /tmp/ab/$tag-w2-$mode-$r.log | awk -v m=$mode -v r=$r '{print "W2", m, r, $0}'
  done
done
