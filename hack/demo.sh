#!/usr/bin/env bash
# The local demo: a real control plane on loopback, the CRDs, the operator, and an
# example LLMService reconciled into pools. Leaves the cluster and operator running;
# `make cluster-down` stops them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
state=.testenv
example="${1:-examples/edge-cloud-small.yaml}"

kubeconfig="$(uv run --no-sync python hack/testenv/cluster.py up --state-dir "$state")"
export KUBECONFIG="$kubeconfig"
kubectl="$state/bin/kubectl"
"$kubectl" apply --server-side -f crds/ >/dev/null
"$kubectl" wait --for=condition=Established crd/llmservices.hybridllm.io --timeout=60s >/dev/null

if [ -f "$state/pids/operator" ] && kill -0 "$(cat "$state/pids/operator")" 2>/dev/null; then
  echo "operator already running (pid $(cat "$state/pids/operator"))"
else
  setsid uv run --no-sync hybridllm operator run >"$state/logs/operator.log" 2>&1 &
  echo $! >"$state/pids/operator"
  echo "operator started (pid $!), log: $state/logs/operator.log"
fi

"$kubectl" apply -f "$example"
name="$(uv run --no-sync python -c "import sys,yaml; print(next(d for d in yaml.safe_load_all(open(sys.argv[1])) if d['kind']=='LLMService')['metadata']['name'])" "$example")"
echo "waiting for llms/$name to become Ready ..."
"$kubectl" wait --for=condition=Ready "llms/$name" --timeout=180s
echo
"$kubectl" get llms -o wide
echo
"$kubectl" get deployments,services,pods -l "app.kubernetes.io/instance=$name" -o wide
cat <<MSG

The cluster and the operator keep running. Try:
  export KUBECONFIG=$KUBECONFIG
  $kubectl explain llmservice.spec.cloud
  $kubectl edit llms $name          # change replicas or cloud.mode and watch the pools follow
  make cluster-down                 # stop everything
MSG
