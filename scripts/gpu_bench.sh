#!/usr/bin/env bash
# The GPU benchmark of issue 28 item 8, as one command on a CUDA machine:
#
#   scripts/gpu_bench.sh OUT_DIR
#
#  1. a randomly initialised model of Qwen3-0.6B's shape, bf16 safetensors, under /tmp
#     (kept between runs; speed does not depend on weight values);
#  2. W1 in nano-vllm's shape (256 requests, 100-1024 tokens in and out, EOS ignored) on
#     pagedllm with CUDA graphs, then HF transformers' `generate` on the first 64 of the
#     same requests (static batches of 64, left padded) on the same GPU, in the same run;
#  3. W2 (one request, 128 in, 256 out) with CUDA graphs and again with --enforce-eager.
#
# Each bench measures the GPU first (bf16 matmul rate, copy bandwidth) and writes its
# JSON (device name, CUDA and torch versions, roofline) and log to OUT_DIR. Every step runs
# under `timeout`, so one hang cannot eat the device time; the JSON is rewritten after
# every row ("partial": true until the end), so a step cut short keeps the rows it
# finished; --keep-going notes an engine that fails (the JSON's "failures") and runs the
# next one. The script goes on to the next step and exits with the first failure's status.
#
# The package need not be installed: the repository root goes on PYTHONPATH.
# GPU_BENCH_SMOKE=1 runs the same commands on the CPU at toy sizes (a 2-layer Qwen3, a
# few short requests): the rehearsal of this script on a machine without a GPU.
set -uo pipefail

OUT=${1:?usage: scripts/gpu_bench.sh OUT_DIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PAGEDLLM_LOGGING_LEVEL=${PAGEDLLM_LOGGING_LEVEL:-WARNING}
export TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"

if [[ ${GPU_BENCH_SMOKE:-0} == 1 ]]; then
    PRESET=qwen3-tiny DEVICE=cpu DTYPE=float32
    MODEL=${GPU_BENCH_MODEL:-/tmp/pagedllm-gpu-bench-qwen3-tiny}
    # toy lengths; the engine's KV budget in bytes (a fraction of RAM would be large)
    W1=(--num-prompts 8 --input-len 8:32 --output-len 4:12 --threads 1
        --kv-cache-memory-bytes $((64 * 2**20)) --quick-machine)
    HF=(--hf-num-prompts 4 --hf-batch-sizes 4)
    W2=(--input-len 16 --output-len 8 --threads 1 --kv-cache-memory-bytes $((64 * 2**20))
        --quick-machine)
    MAKE_S=300 W1_S=600 W2_S=300
else
    PRESET=qwen3-0.6b DEVICE=cuda DTYPE=bfloat16
    MODEL=${GPU_BENCH_MODEL:-/tmp/pagedllm-gpu-bench-qwen3-0.6b}
    # 256 requests of up to 2048 tokens hold ~290k tokens of KV at once (112 KiB each in
    # bf16): the KV cache the engine sizes from its profiled warm-up (0.9 of the GPU, less
    # weights and peak activations) holds several times that on an H100, so nothing is
    # preempted; HF loads only after pagedllm is freed.
    W1=(--num-prompts 256 --max-model-len 4096)
    # HF generate on all 256 would take minutes: the first 64, in one batch of 64.
    HF=(--hf-num-prompts 64 --hf-batch-sizes 64)
    # One stream: graphs for batch sizes up to 16 are all W2 uses (fewer to capture).
    W2=(--max-num-seqs 16 --max-model-len 4096 --latency-iters 3)
    MAKE_S=60 W1_S=180 W2_S=80
    # The CUDA path never asks for the C++ CPU kernels (tests/gpu checks that); this only
    # keeps a timed run from spending its minutes on a build if a change ever did.
    export PAGEDLLM_CPU_KERNELS=${PAGEDLLM_CPU_KERNELS:-0}
fi

status=0
step() {  # step NAME SECONDS CMD...: run CMD under timeout, log to OUT/NAME.log
    local name=$1 secs=$2
    shift 2
    echo "=== $name (timeout ${secs}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$secs" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
    if [[ $rc -ne 0 && $status -eq 0 ]]; then status=$rc; fi
    return "$rc"
}

if [[ ! -f "$MODEL/config.json" ]]; then
    step make-model "$MAKE_S" "$PY" -m pagedllm.bench.random_model "$PRESET" "$MODEL" \
        --dtype bfloat16 --device "$DEVICE" || exit "$status"
fi

if [[ $DEVICE == cuda ]]; then
    "$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda,
                                  torch.cuda.get_device_name())' | tee "$OUT/device.log"
fi

step throughput "$W1_S" "$PY" -m pagedllm.entrypoints.cli bench throughput \
    --model "$MODEL" --shape nanovllm --device "$DEVICE" --dtype "$DTYPE" \
    --compare hf "${HF[@]}" "${W1[@]}" --keep-going \
    --output-json "$OUT/throughput-nanovllm.json"

step latency "$W2_S" "$PY" -m pagedllm.entrypoints.cli bench latency \
    --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" --eager-too "${W2[@]}" --keep-going \
    --output-json "$OUT/latency-w2.json"

echo "results in $OUT: $(cd "$OUT" && ls)"
exit "$status"
