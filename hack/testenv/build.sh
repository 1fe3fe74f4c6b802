#!/usr/bin/env bash
# Builds the test environment (the control plane: kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, etcd, kwok; and what its real node runs beside Debian's
# containerd: kubelet, kube-proxy, CoreDNS) from the Go module proxy at the versions
# pinned in versions.env, and caches the binaries under
# ~/.cache/hybridllm/testenv/<versions>/bin. A second run with the binaries
# present only checks their versions. Prints the directory holding the binaries.
#
# The checksum database may be out of reach here: GOSUMDB=off, and the committed
# go.sum files are the record of what was built.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$here/versions.env"

key="k8s-${KUBERNETES_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}_coredns-${COREDNS_VERSION}"
cache="${HYBRIDLLM_TESTENV_CACHE:-$HOME/.cache/hybridllm/testenv}/$key"
bin="$cache/bin"
log() { echo "[testenv-build] $*" >&2; }

have_all() {
  for b in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy etcd kwok coredns; do
    [ -x "$bin/$b" ] || return 1
  done
  [ -f "$bin/kwok-stages.yaml" ] || return 1
  # Capture first: grep -q closing the pipe early would fail the pipeline under pipefail.
  local apiserver etcd
  apiserver="$("$bin/kube-apiserver" --version 2>/dev/null)" || return 1
  etcd="$("$bin/etcd" --version 2>/dev/null)" || return 1
  [ "$apiserver" = "Kubernetes ${KUBERNETES_VERSION}" ] || return 1
  [[ "$etcd" == *"etcd Version: ${ETCD_VERSION#v}"* ]] || return 1
}

if have_all; then
  log "cached: $bin ($("$bin/kube-apiserver" --version))"
  echo "$bin"
  exit 0
fi

# shellcheck source=go-env.sh
source "$here/go-env.sh"
mkdir -p "$bin.partial"
start=$SECONDS

k8s_minor="${KUBERNETES_VERSION#v1.}"; k8s_minor="${k8s_minor%%.*}"
build_date="2026-01-01T00:00:00Z"   # fixed, so the build is reproducible
vpkg=k8s.io/component-base/version
k8s_ldflags="-s -w -X $vpkg.gitVersion=${KUBERNETES_VERSION} -X $vpkg.gitMajor=1 -X $vpkg.gitMinor=${k8s_minor}"
k8s_ldflags+=" -X $vpkg.gitTreeState=clean -X $vpkg.buildDate=${build_date} -X $vpkg.gitCommit=hybridllm-testenv"
k8s_ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=${KUBERNETES_VERSION}"

log "building Kubernetes ${KUBERNETES_VERSION} (cold: 15-30 min on 2 cores)"
(cd "$here/k8s" && go mod download && \
  go build -trimpath -ldflags "$k8s_ldflags" -o "$bin.partial/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy)
log "Kubernetes done after $((SECONDS - start))s; building etcd ${ETCD_VERSION}"
(cd "$here/etcd" && go build -trimpath -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=hybridllm-testenv" -o "$bin.partial/etcd" .)
log "etcd done after $((SECONDS - start))s; building kwok ${KWOK_VERSION}"
(cd "$here/kwok" && go build -trimpath \
  -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION} -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=${KUBERNETES_VERSION}" \
  -o "$bin.partial/kwok" sigs.k8s.io/kwok/cmd/kwok)
log "kwok done after $((SECONDS - start))s; building CoreDNS ${COREDNS_VERSION}"
(cd "$here/coredns" && go build -trimpath \
  -ldflags "-s -w -X github.com/coredns/coredns/coremain.GitCommit=hybridllm-testenv" \
  -o "$bin.partial/coredns" github.com/coredns/coredns)
# kwok's own "fast" stages (nodes become Ready with lease heartbeats, pods become Running
# and Ready at once), taken from the pinned kwok module rather than copied into this repo.
kwok_dir="$(cd "$here/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
         pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
  echo "---"; cat "$kwok_dir/kustomize/stage/$f"
done > "$bin.partial/kwok-stages.yaml"
rm -rf "$bin" && mv "$bin.partial" "$bin"
log "built in $((SECONDS - start))s: $bin"
have_all || { log "built binaries do not report the pinned versions"; exit 1; }
echo "$bin"
