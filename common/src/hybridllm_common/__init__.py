"""hybridllm shared models: LLMService/EdgeFleet spec and status, OpenAI protocol, metric names."""
