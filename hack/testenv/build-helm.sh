#!/usr/bin/env bash
# Builds helm (helm.sh/helm/v3/cmd/helm) and the helm-unittest plugin
# (github.com/helm-unittest/helm-unittest) from the Go module proxy at the versions pinned
# in helm/go.mod (HELM_VERSION and HELM_UNITTEST_VERSION in versions.env), and caches them
# under ~/.cache/hybridllm/testenv/helm-<v>_unittest-<v>/: bin/helm, and the plugin
# installed as plugins/unittest (point HELM_PLUGINS there). A second run with both present
# only checks their versions. Prints the directory holding bin/ and plugins/.
#
# The plugin is installed by hand, not with `helm plugin install`: that would fetch a
# release binary from GitHub. Its plugin.yaml is the upstream one reduced to this platform.
#
# The checksum database may be out of reach here: GOSUMDB=off, and the committed
# go.sum is the record of what was built.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

cache="${HYBRIDLLM_TESTENV_CACHE:-$HOME/.cache/hybridllm/testenv}/helm-${HELM_VERSION}_unittest-${HELM_UNITTEST_VERSION}"
log() { echo "[testenv-build] $*" >&2; }

have_it() {
  [ -x "$cache/bin/helm" ] && [ -x "$cache/plugins/unittest/untt" ] || return 1
  [ -f "$cache/plugins/unittest/plugin.yaml" ] || return 1
  local v
  v="$("$cache/bin/helm" version --template '{{.Version}}' 2>/dev/null)" || return 1
  [ "$v" = "$HELM_VERSION" ] || return 1
  v="$(HELM_PLUGINS="$cache/plugins" "$cache/bin/helm" plugin list 2>/dev/null)" || return 1
  [[ "$v" == *"unittest"*"${HELM_UNITTEST_VERSION#v}"* ]] || return 1
}

if have_it; then
  log "cached: $cache (helm ${HELM_VERSION}, helm-unittest ${HELM_UNITTEST_VERSION})"
  echo "$cache"
  exit 0
fi

# shellcheck source=go-env.sh
source "$here/go-env.sh"
start=$SECONDS
for pin in "helm.sh/helm/v3 $HELM_VERSION" "github.com/helm-unittest/helm-unittest $HELM_UNITTEST_VERSION"; do
  got="$(cd "$here/helm" && go list -m -f '{{.Version}}' "${pin% *}")"
  [ "$got" = "${pin#* }" ] || { log "helm/go.mod pins ${pin% *} $got, versions.env says ${pin#* }"; exit 1; }
done
rm -rf "$cache.partial" && mkdir -p "$cache.partial/bin" "$cache.partial/plugins/unittest"
log "downloading helm ${HELM_VERSION}, helm-unittest ${HELM_UNITTEST_VERSION} and their dependencies"
(cd "$here/helm" && go mod download)
log "downloaded after $((SECONDS - start))s; building (cold: several minutes on 2 cores)"
# As helm's Makefile does: the Kubernetes version `helm template` and `helm lint` assume
# without a cluster is the one of the client-go it is built with (v0.37 -> 1.37).
kube="$(cd "$here/helm" && go list -m -f '{{.Version}}' k8s.io/client-go)"
kube_minor="${kube#v0.}"; kube_minor="${kube_minor%%.*}"
kv="-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=${kube_minor}"
kv+=" -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=${kube_minor}"
(cd "$here/helm" && go build -trimpath \
  -ldflags "-s -w $kv -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION} -X helm.sh/helm/v3/internal/version.gitCommit=hybridllm-testenv -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
  -o "$cache.partial/bin/helm" helm.sh/helm/v3/cmd/helm)
(cd "$here/helm" && go build -trimpath -ldflags "-s -w $kv" \
  -o "$cache.partial/plugins/unittest/untt" github.com/helm-unittest/helm-unittest/cmd/helm-unittest)
cat > "$cache.partial/plugins/unittest/plugin.yaml" <<YAML
name: "unittest"
version: "${HELM_UNITTEST_VERSION#v}"
usage: "unittest for helm charts"
description: "Unit test for helm chart in YAML (built by hybridllm's hack/testenv/build-helm.sh)."
ignoreFlags: false
command: "\$HELM_PLUGIN_DIR/untt"
YAML
rm -rf "$cache" && mv "$cache.partial" "$cache"
log "built in $((SECONDS - start))s: $cache"
have_it || { log "the built helm or plugin does not report the pinned version"; exit 1; }
echo "$cache"
