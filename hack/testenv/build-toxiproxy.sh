#!/usr/bin/env bash
# Builds toxiproxy-server (github.com/Shopify/toxiproxy/v2/cmd/server) from the Go module
# proxy at the version pinned in toxiproxy/go.mod (TOXIPROXY_VERSION in versions.env), and
# caches the binary under ~/.cache/hybridllm/testenv/toxiproxy-<version>/bin. It shapes the
# WAN between a site and the cloud in user space (this kernel has no netem): latency,
# jitter, bandwidth and cuts per link, driven by its HTTP API (hack/topology/wan.py). A
# second run with the binary present only checks its version. Prints the directory
# holding bin/toxiproxy-server.
#
# The checksum database may be out of reach here: GOSUMDB=off, and the committed
# go.sum is the record of what was built.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

cache="${HYBRIDLLM_TESTENV_CACHE:-$HOME/.cache/hybridllm/testenv}/toxiproxy-${TOXIPROXY_VERSION}"
log() { echo "[testenv-build] $*" >&2; }

have_it() {
  [ -x "$cache/bin/toxiproxy-server" ] || return 1
  local v
  v="$("$cache/bin/toxiproxy-server" -version 2>&1)" || return 1
  [[ "$v" == *"${TOXIPROXY_VERSION#v}"* ]] || return 1
}

if have_it; then
  log "cached: $cache (toxiproxy ${TOXIPROXY_VERSION})"
  echo "$cache"
  exit 0
fi

# shellcheck source=go-env.sh
source "$here/go-env.sh"
start=$SECONDS
got="$(cd "$here/toxiproxy" && go list -m -f '{{.Version}}' github.com/Shopify/toxiproxy/v2)"
[ "$got" = "$TOXIPROXY_VERSION" ] || { log "toxiproxy/go.mod pins $got, versions.env says $TOXIPROXY_VERSION"; exit 1; }
rm -rf "$cache.partial" && mkdir -p "$cache.partial/bin"
log "downloading toxiproxy ${TOXIPROXY_VERSION} and its dependencies"
(cd "$here/toxiproxy" && go mod download)
log "downloaded after $((SECONDS - start))s; building toxiproxy-server ${TOXIPROXY_VERSION} (cold: under a minute on 2 cores)"
(cd "$here/toxiproxy" && go build -trimpath \
  -ldflags "-s -w -X github.com/Shopify/toxiproxy/v2.Version=${TOXIPROXY_VERSION#v}" \
  -o "$cache.partial/bin/toxiproxy-server" github.com/Shopify/toxiproxy/v2/cmd/server)
rm -rf "$cache" && mv "$cache.partial" "$cache"
log "built in $((SECONDS - start))s: $cache"
have_it || { log "the built toxiproxy-server does not report the pinned version"; exit 1; }
echo "$cache"
