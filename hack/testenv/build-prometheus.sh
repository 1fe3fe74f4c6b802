#!/usr/bin/env bash
# Builds a real Prometheus server (github.com/prometheus/prometheus/cmd/prometheus) from
# the Go module proxy at the version pinned in prometheus/go.mod (PROMETHEUS_VERSION in
# versions.env), and caches the binary under
# ~/.cache/hybridllm/testenv/prometheus-<version>/bin, apart from build.sh's control plane
# so that neither's cache key moves with the other. A second run with the binary
# present only checks its version. Prints the directory holding the binary.
#
# Built without the builtinassets tag: the web UI is not embedded (its pages answer with
# an error), the HTTP API (/api/v1/*, /-/ready, /-/reload) is all there.
#
# The checksum database may be out of reach here: GOSUMDB=off, and the committed
# go.sum is the record of what was built.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"   # PROMETHEUS_VERSION (build.sh's key reads only its own four)

# The module version pinned in prometheus/go.mod whose VERSION file is PROMETHEUS_VERSION
# (Prometheus 3.x is module v0.3xx.y). Change the two together.
PROMETHEUS_MODULE_VERSION=v0.316.0

cache="${HYBRIDLLM_TESTENV_CACHE:-$HOME/.cache/hybridllm/testenv}/prometheus-${PROMETHEUS_VERSION}"
bin="$cache/bin"
log() { echo "[testenv-build] $*" >&2; }

have_it() {
  [ -x "$bin/prometheus" ] || return 1
  # Capture first: grep -q closing the pipe early would fail the pipeline under pipefail.
  local v
  v="$("$bin/prometheus" --version 2>/dev/null)" || return 1
  [[ "$v" == "prometheus, version ${PROMETHEUS_VERSION#v} "* ]] || return 1
}

if have_it; then
  log "cached: $bin ($("$bin/prometheus" --version 2>/dev/null | head -n1))"
  echo "$bin"
  exit 0
fi

# shellcheck source=go-env.sh
source "$here/go-env.sh"
start=$SECONDS
pinned="$(cd "$here/prometheus" && go list -m -f '{{.Version}}' github.com/prometheus/prometheus)"
[ "$pinned" = "$PROMETHEUS_MODULE_VERSION" ] || {
  log "prometheus/go.mod pins $pinned, this script expects $PROMETHEUS_MODULE_VERSION (Prometheus $PROMETHEUS_VERSION)"
  exit 1
}
rm -rf "$bin.partial" && mkdir -p "$bin.partial"

vpkg=github.com/prometheus/common/version
ldflags="-s -w -X $vpkg.Version=${PROMETHEUS_VERSION#v} -X $vpkg.Revision=hybridllm-testenv"
ldflags+=" -X $vpkg.Branch=release -X $vpkg.BuildDate=20260101-00:00:00"   # fixed, so the build is reproducible

log "downloading Prometheus ${PROMETHEUS_VERSION} (module ${PROMETHEUS_MODULE_VERSION}) and its dependencies"
(cd "$here/prometheus" && go mod download)
log "downloaded after $((SECONDS - start))s; building Prometheus ${PROMETHEUS_VERSION} (cold: several minutes on 2 cores)"
(cd "$here/prometheus" && go build -trimpath -ldflags "$ldflags" \
  -o "$bin.partial/prometheus" github.com/prometheus/prometheus/cmd/prometheus)
rm -rf "$bin" && mv "$bin.partial" "$bin"
log "built in $((SECONDS - start))s: $bin"
have_it || { log "the built binary does not report the pinned version"; exit 1; }
echo "$bin"
