"""hybridllm gateway: the OpenAI-compatible front door (edge/cloud routing)."""
