"""Local mode: the same LLMService manifest, the same renderer, on one machine without
Kubernetes (``hybridllm up``). :mod:`.plan` places the operator's pools on loopback,
:mod:`.supervisor` runs and watches them (its processes and probes in :mod:`.processes`,
the gateway's routing table in :mod:`.routing`, the autoscaling and rollout loops it shares
with the operator in :mod:`.loops`), :mod:`.cli` is the command line."""
