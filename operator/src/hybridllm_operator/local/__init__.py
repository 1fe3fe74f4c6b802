"""Local mode: the same LLMService manifest, the same renderer, on one machine without
Kubernetes (``hybridllm up``). :mod:`.plan` places the operator's pools on loopback,
:mod:`.supervisor` runs and watches them, :mod:`.cli` is the command line."""
