"""hybridllm gateway: OpenAI-compatible front door routing between edge and cloud."""
