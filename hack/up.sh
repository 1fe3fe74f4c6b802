#!/usr/bin/env bash
# The README's first command (`make up`): run an LLMService manifest on this machine with
# `hybridllm up` (gateway, edge and cloud tiers as supervised local processes, the real
# model), then ask it one question per tier with the openai SDK. Leaves it running;
# `make down` (or `hybridllm down`) stops it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
example="${EXAMPLE:-examples/hybrid-cpu.yaml}"
port="${PORT:-8080}"
name="$(uv run --no-sync python -c "import sys,yaml; print(next(d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d.get('kind')=='LLMService')['metadata']['name'])" "$example")"

if uv run --no-sync hybridllm status "$name" >/dev/null 2>&1; then
  echo "$name is already running:"
  uv run --no-sync hybridllm status "$name"
  url="$(uv run --no-sync hybridllm status "$name" --json | uv run --no-sync python -c "import json,sys; print(json.load(sys.stdin)['gateway_url'])")"
else
  uv run --no-sync hybridllm up -d -f "$example" --port "$port"
  url="http://127.0.0.1:$port"
fi
uv run --no-sync python hack/ask.py "$url/v1" --local
