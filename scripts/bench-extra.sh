#!/usr/bin/env bash
# Optional: build llama-cpp-python from source into ./.venv, for bench/native_bench.py's llama.cpp column.
# A native build (GGML_NATIVE=ON) died with "Illegal instruction" on these machines, so the CPU
# features are named explicitly; AVX512 only where /proc/cpuinfo lists it. Takes 10-20 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
if grep -qw avx512f /proc/cpuinfo; then
    flags="$flags -DGGML_AVX512=ON"
    # the extensions ggml has kernels for, each only where the CPU lists it
    grep -qw avx512_vnni /proc/cpuinfo && flags="$flags -DGGML_AVX512_VNNI=ON"
    grep -qw avx512vbmi /proc/cpuinfo && flags="$flags -DGGML_AVX512_VBMI=ON"
    grep -qw avx512_bf16 /proc/cpuinfo && flags="$flags -DGGML_AVX512_BF16=ON"
fi
CMAKE_ARGS="$flags" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    .venv/bin/python -m pip install -q --no-cache-dir "llama-cpp-python==0.3.36"
.venv/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
