"""hybridllm edge runtime and agent: llama.cpp and onnxruntime backends, without torch."""
