"""hybridllm model store and format conversion (GGUF, safetensors, ONNX); the store needs no torch."""
