"""hybridllm Kubernetes operator (kopf): reconciles LLMService into edge, cloud and gateway pools."""
