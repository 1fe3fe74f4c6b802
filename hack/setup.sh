#!/usr/bin/env bash
# Everything a fresh machine needs before `make demo` or `make test`: uv, the Python
# workspace (uv.lock, all members, dev tools), and the test control plane's binaries.
# Idempotent; caches live in fixed directories under ~/.cache so a second run is quick:
#   ~/.cache/uv                       wheels, including the llama-cpp-python build
#   ~/.cache/hybridllm/go             Go module and build caches
#   ~/.cache/hybridllm/testenv        the built control-plane and node binaries
#   ~/.cache/hybridllm/images         image layers (hack/images/oci.py)
#   ~/.cache/hybridllm/containerd     the real node's image store
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

UV_VERSION=0.13.9
if ! command -v uv >/dev/null 2>&1 || [ "$(uv --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
  echo "[setup] installing uv $UV_VERSION"
  python3 -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
fi
export UV_CACHE_DIR="${UV_CACHE_DIR:-$HOME/.cache/uv}"
echo "[setup] syncing the Python workspace (first run: torch and a llama.cpp build, ~15 min)"
# Offline first: it accepts the cached package index even when the registry's answers
# carry no cache lifetime, so the llama.cpp wheel built last time is reused instead of
# rebuilt. Online when something is not in the cache yet (a cold machine, a new lock).
# --compile-bytecode: every module's .pyc is written once here. Where the environment sets
# PYTHONDONTWRITEBYTECODE (CI machines do), Python never writes them itself and would
# compile torch and the rest from source in every process: `import torch` took 10 s instead
# of 3 on two cores, and the tests start hundreds of processes.
if ! uv sync --all-packages --frozen --offline --compile-bytecode --quiet 2>/dev/null; then
  uv sync --all-packages --frozen --compile-bytecode
fi
# the workspace's own packages are installed editable (their source folders): the same
uv run --no-sync python -m compileall -q -j 0 ./*/src >/dev/null

if [ "${HYBRIDLLM_SKIP_TESTENV:-0}" != "1" ]; then
  # The real node of the test environment (hack/testenv/node.py) and the image builder
  # (hack/images/oci.py) use Debian's container runtime, CNI plugins, mmdebstrap, and the
  # Debian python3.11 the images carry (their environments are built against it here);
  # the dashboard page's tests open it in Debian's headless Chromium (with a font: it is
  # only recommended, and the packages are installed without recommends).
  node_packages=(containerd runc containernetworking-plugins catatonit mmdebstrap iptables iproute2 python3.11 chromium fonts-liberation)
  missing=()
  for p in "${node_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
      echo "[setup] the real-node tests need these Debian packages (as root): ${missing[*]}" >&2
      exit 1
    fi
    echo "[setup] installing ${missing[*]} from Debian (~1 min)"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  echo "[setup] building the test control plane (first run: ~25 min on 2 cores; cached after)"
  hack/testenv/build.sh >/dev/null
  echo "[setup] building Prometheus for the autoscaling tests (first run: ~5-7 min; cached after)"
  hack/testenv/build-prometheus.sh >/dev/null
  echo "[setup] building helm and helm-unittest for the chart tests (first run: ~3-5 min; cached after)"
  hack/testenv/build-helm.sh >/dev/null
fi
