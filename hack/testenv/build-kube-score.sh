#!/usr/bin/env bash
# Builds kube-score (github.com/zegl/kube-score/cmd/kube-score) from the Go module proxy at
# the version pinned in kube-score/go.mod (KUBE_SCORE_VERSION in versions.env), and caches
# the binary under ~/.cache/hybridllm/testenv/kube-score-<version>/bin, apart from the
# other tools so that no cache key moves with another. A second run with the binary
# present only checks its version. Prints the directory holding bin/kube-score.
#
# The checksum database may be out of reach here: GOSUMDB=off, and the committed
# go.sum is the record of what was built.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

cache="${HYBRIDLLM_TESTENV_CACHE:-$HOME/.cache/hybridllm/testenv}/kube-score-${KUBE_SCORE_VERSION}"
log() { echo "[testenv-build] $*" >&2; }

have_it() {
  [ -x "$cache/bin/kube-score" ] || return 1
  local v
  v="$("$cache/bin/kube-score" version 2>/dev/null)" || return 1
  [[ "$v" == "kube-score version: ${KUBE_SCORE_VERSION#v},"* ]] || return 1
}

if have_it; then
  log "cached: $cache (kube-score ${KUBE_SCORE_VERSION})"
  echo "$cache"
  exit 0
fi

# shellcheck source=go-env.sh
source "$here/go-env.sh"
start=$SECONDS
got="$(cd "$here/kube-score" && go list -m -f '{{.Version}}' github.com/zegl/kube-score)"
[ "$got" = "$KUBE_SCORE_VERSION" ] || { log "kube-score/go.mod pins $got, versions.env says $KUBE_SCORE_VERSION"; exit 1; }
rm -rf "$cache.partial" && mkdir -p "$cache.partial/bin"
log "downloading kube-score ${KUBE_SCORE_VERSION} and its dependencies"
(cd "$here/kube-score" && go mod download)
log "downloaded after $((SECONDS - start))s; building kube-score ${KUBE_SCORE_VERSION} (cold: about a minute on 2 cores)"
# As its goreleaser does: the version, commit and date `kube-score version` prints (the
# date fixed, so that the build is reproducible).
(cd "$here/kube-score" && go build -trimpath \
  -ldflags "-s -w -X main.version=${KUBE_SCORE_VERSION#v} -X main.commit=hybridllm-testenv -X main.date=2026-01-01T00:00:00Z" \
  -o "$cache.partial/bin/kube-score" github.com/zegl/kube-score/cmd/kube-score)
rm -rf "$cache" && mv "$cache.partial" "$cache"
log "built in $((SECONDS - start))s: $cache"
have_it || { log "the built kube-score does not report the pinned version"; exit 1; }
echo "$cache"
