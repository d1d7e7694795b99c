#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-cli, llama-quantize and llama-bench for this CPU
# (Release, -march=native) from the llama.cpp vendored in the llama-cpp-python sdist, so the
# version is pinned and no git clone is needed. About 4-5 minutes on 2 cores; a second run
# with the binaries present does nothing. The bench looks for llama-server where this puts
# it (pagedllm/bench/llamacpp_runner.py: default_llama_server).
#
#   scripts/build_llamacpp.sh            # -> ~/.cache/pagedllm/llama.cpp/build/bin/
#   PAGEDLLM_LLAMACPP_DIR=/opt/llama.cpp scripts/build_llamacpp.sh
#
# On a CPU with AMX-INT8 the build leaves out llama.cpp's AMX backend: on the Xeon VMs we run
# on it segfaults in ggml_backend_amx_mul_mat at the first prompt (llama.cpp issue #20824,
# open; ollama dropped its AMX build for the same crash). llama.cpp then runs its AVX-512
# repacked kernels, its fastest path that works there. PAGEDLLM_LLAMACPP_AMX=1 keeps AMX.
# A build made with other settings is rebuilt (build/pagedllm-build.txt records them).
set -euo pipefail
version="0.3.36"  # llama-cpp-python, whose vendor/llama.cpp is built
root="${PAGEDLLM_LLAMACPP_DIR:-$HOME/.cache/pagedllm/llama.cpp}"
bin="$root/build/bin"
targets=(llama-server llama-cli llama-quantize llama-bench)
python="${PYTHON:-$(dirname "$0")/../.venv/bin/python}"
[[ -x "$python" ]] || python="python3"

cflags=""
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null && [[ "${PAGEDLLM_LLAMACPP_AMX:-0}" != 1 ]]; then
    cflags="-U__AMX_INT8__"  # -march=native defines it; ggml's AMX backend is built under it
fi
stamp="llama-cpp-python $version; GGML_NATIVE=ON; CFLAGS=$cflags"
built() {
    for t in "${targets[@]}"; do [[ -x "$bin/$t" ]] || return 1; done
    [[ "$(cat "$root/build/pagedllm-build.txt" 2>/dev/null)" == "$stamp" ]]
}
if built; then
    echo "llama.cpp already built: $bin"
    exit 0
fi
mkdir -p "$root/sdist"
sdist=$(ls "$root"/sdist/llama_cpp_python-"$version".tar.gz 2>/dev/null || true)
if [[ -z "$sdist" ]]; then
    echo "downloading the llama-cpp-python $version sdist ..."
    "$python" -m pip download --disable-pip-version-check -q "llama-cpp-python==$version" \
        --no-deps --no-binary :all: -d "$root/sdist"
    sdist="$root/sdist/llama_cpp_python-$version.tar.gz"
fi
src="$root/src"
if [[ ! -f "$src/CMakeLists.txt" ]]; then
    echo "unpacking vendor/llama.cpp ..."
    rm -rf "$src" "$root/unpack" && mkdir -p "$root/unpack"
    tar -xzf "$sdist" -C "$root/unpack"
    mv "$root/unpack/llama_cpp_python-$version/vendor/llama.cpp" "$src"
    rm -rf "$root/unpack"
fi
echo "building ${targets[*]} (Release, native CPU${cflags:+, without AMX}) in $root/build ..."
cmake -S "$src" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$cflags" -DCMAKE_CXX_FLAGS="$cflags" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$root/build" --target "${targets[@]}" -j "$(nproc)"
echo "$stamp" > "$root/build/pagedllm-build.txt"
built || { echo "build_llamacpp.sh: some binaries are missing from $bin" >&2; exit 1; }
echo "llama.cpp built: $bin"
for t in "${targets[@]}"; do echo "  $bin/$t"; done
