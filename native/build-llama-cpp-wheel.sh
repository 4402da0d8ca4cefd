#!/usr/bin/env bash
# Builds llama-cpp-python from its source release, with specdec's patch to llama.cpp's CPU kernels applied, for this
# CPU, and leaves the wheel in OUT. Extra CMake options come from $CMAKE_ARGS. A failed build leaves nothing in OUT.
#
#   native/build-llama-cpp-wheel.sh PYTHON VERSION OUT
#
# The patch (llama.cpp-verify-columns.patch, next to this script) adds multi-column K-quant dot products: a pass over
# 2-16 tokens unpacks each weight block once for up to 8 of them, and each token's results are bit-identical to a
# one-token pass, so a speculative verify pass is both cheaper and exact. Which kernels take a pass of each width (these
# or llama.cpp's own) is a kernel plan set at run time (ggml_cpu_set_kernel_plan; specdec calibrates it per CPU).
# ggml's public headers go into OUT/include beside the wheel: the kernel test (native/test-kernel-plan.c) compiles
# against them and the installed libraries.
set -euo pipefail

python=$1 version=$2 out=$3
here=$(cd "$(dirname "$0")" && pwd)
work=$out.partial
source_dir=$work/src/llama_cpp_python-$version

rm -rf "$work"
mkdir -p "$work/src"
"$python" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$work"
tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work/src"
patch --quiet --forward --batch -p1 -d "$source_dir/vendor/llama.cpp" < "$here/llama.cpp-verify-columns.patch"
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "$python" -m pip wheel --quiet --no-cache-dir --no-deps "$source_dir" -w "$work"
mkdir -p "$work/include"
cp "$source_dir"/vendor/llama.cpp/ggml/include/*.h "$work/include/"
mkdir -p "$out"
rm -rf "$out/include"
mv "$work/include" "$out/include"
mv "$work"/llama_cpp_python-"$version"-*.whl "$out"/
rm -rf "$work"
