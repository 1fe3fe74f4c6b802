#!/usr/bin/env bash
# llama.cpp's own server, llama-server, built from the llama.cpp source that the locked
# llama-cpp-python vendors: the same commit, so the same kernels as our edge runtime and
# as llama_cpp.server. The sdist is the one uv.lock pins (its URL and sha256); the CMake
# flags are the ones this repository builds llama-cpp-python with (pyproject.toml:
# GGML_NATIVE=OFF, a portable build), plus what a server needs offline: no web UI download
# (LLAMA_USE_PREBUILT_UI=OFF), no OpenSSL, no tests or examples.
#
# Cached in ~/.cache/hybridllm/llama-server/<version>/ (about 8 minutes on two cores the
# first time); prints the binary's path. Needs cmake, ninja and a C++ compiler (Debian:
# cmake ninja-build g++).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
read -r VERSION URL SHA < <(python3 - "$ROOT/uv.lock" <<'EOF'
import sys, tomllib
lock = tomllib.load(open(sys.argv[1], "rb"))
pkg = next(p for p in lock["package"] if p["name"] == "llama-cpp-python")
print(pkg["version"], pkg["sdist"]["url"], pkg["sdist"]["hash"].removeprefix("sha256:"))
EOF
)
CACHE=${HYBRIDLLM_LLAMA_SERVER_CACHE:-$HOME/.cache/hybridllm/llama-server}/$VERSION
BIN=$CACHE/bin/llama-server
if [[ -x $BIN ]]; then
    echo "$BIN"
    exit 0
fi
for tool in cmake ninja g++; do
    command -v "$tool" >/dev/null || { echo "build-llama-server: $tool is missing (Debian: apt-get install cmake ninja-build g++)" >&2; exit 1; }
done
mkdir -p "$CACHE"
SDIST=$CACHE/llama_cpp_python-$VERSION.tar.gz
if [[ ! -f $SDIST ]] || ! echo "$SHA  $SDIST" | sha256sum --check --status; then
    echo "build-llama-server: downloading llama-cpp-python $VERSION's sdist from PyPI" >&2
    curl -fsSL --retry 3 -o "$SDIST.part" "$URL"
    echo "$SHA  $SDIST.part" | sha256sum --check --status \
        || { echo "build-llama-server: $URL does not match uv.lock's sha256" >&2; exit 1; }
    mv "$SDIST.part" "$SDIST"
fi
rm -rf "$CACHE/src" "$CACHE/build"
mkdir -p "$CACHE/src"
tar -xzf "$SDIST" -C "$CACHE/src" --strip-components=1
LLAMA=$CACHE/src/vendor/llama.cpp
echo "build-llama-server: building llama-server from llama-cpp-python $VERSION's llama.cpp" >&2
cmake -S "$LLAMA" -B "$CACHE/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$CACHE/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$CACHE/bin"
cp "$CACHE/build/bin/llama-server" "$BIN.part"
mv "$BIN.part" "$BIN"
rm -rf "$CACHE/build" "$CACHE/src"
echo "$BIN"
