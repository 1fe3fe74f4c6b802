"""hybridllm cloud runtime: paged-KV continuous-batching engine in torch."""
