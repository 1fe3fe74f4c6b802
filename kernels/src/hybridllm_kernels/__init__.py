"""hybridllm Triton kernels for the cloud engine, each with a plain-torch reference."""
