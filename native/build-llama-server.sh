#!/usr/bin/env bash
# Builds upstream llama-server, the baseline `specdec bench-servers` measures against, from the llama.cpp source that
# llama-cpp-python's source release VERSION vendors, WITHOUT specdec's kernel patch, for this CPU. The binary is linked
# statically against ggml/llama (it runs from OUT as it is) and lands in OUT/llama-server. The build is offline: no
# libcurl, no OpenSSL, no prebuilt web UI download. A failed build leaves nothing in OUT.
#
#   native/build-llama-server.sh PYTHON VERSION OUT
set -euo pipefail

python=$1 version=$2 out=$3
work=$out.partial
source_dir=$work/src/llama_cpp_python-$version/vendor/llama.cpp

rm -rf "$work"
mkdir -p "$work/src"
"$python" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$work"
tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work/src"
# Logs stay in OUT.partial; on failure their tail is shown.
run_logged() {
	local log=$1
	shift
	"$@" > "$log" 2>&1 || { tail -n 40 "$log" >&2; echo "failed; full log: $log" >&2; return 1; }
}
run_logged "$work/cmake.log" cmake -S "$source_dir" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
	-DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
run_logged "$work/build.log" cmake --build "$work/build" --target llama-server -j"$(nproc)"
"$work/build/bin/llama-server" --version
mkdir -p "$work/out"
cp "$work/build/bin/llama-server" "$work/out/"
rm -rf "$out"
mv "$work/out" "$out"
rm -rf "$work"
