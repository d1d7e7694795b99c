#!/usr/bin/env bash
# What a GPU machine that can fetch nothing needs for scripts/gpu_check.sh, prepared here
# (run after scripts/setup.sh): wheels of pagedllm's dependencies and the test clients that
# a CUDA image typically lacks, in .whl/, and the bundled model's tokenizer (tokenizer.json
# and a tokenizer-only GGUF, 5 MB, where the 93 MB model would not travel) in .gpu/tokenizer.
# There, before gpu_check.sh:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site PAGEDLLM_GPU_SUITE_TOKENIZER=$PWD/.gpu/tokenizer
# Both folders are ignored by git (.git/info/exclude). Python 3.12, x86-64 manylinux.
set -euo pipefail
cd "$(dirname "$0")/.."
for d in .whl .gpu; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
rm -rf .whl && mkdir -p .whl .gpu/tokenizer
tmp=$(mktemp -d)
platforms=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform any -d "$tmp" \
    "openai>=3.57" "gguf>=0.11" "fastapi>=0.115.12" "uvicorn>=0.32.1" "llguidance>=1.9.1"
# what the CUDA image (torch 2.11, numpy 2.5, requests, click, h11, anyio...) lacks; typing
# extensions and anyio too, for the versions openai and pydantic ask
for name in annotated_types anyio fastapi gguf httpcore2 httpx2 jiter llguidance openai \
        opentelemetry_api pydantic-2 pydantic_core sniffio starlette truststore \
        typing_extensions typing_inspection uvicorn; do
    cp "$tmp"/"$name"*.whl .whl/
done
rm -rf "$tmp"
.venv/bin/python - <<'PY'
import sys
sys.path.insert(0, "tests")
from pagedllm.loader import load_model_source
from gguf_from_hf import save_tokenizer_gguf
load_model_source(None).tokenizer.save_pretrained(".gpu/tokenizer")
print("saved", save_tokenizer_gguf(".gpu/tokenizer"))
PY
du -sh .whl .gpu
