"""hybridllm edge runtime: llama.cpp and onnxruntime backends behind the OpenAI HTTP API.

Nothing here imports torch: the distribution runs on edge devices that cannot carry it.
"""

from hybridllm_edge.config import EdgeSettings

__all__ = ["EdgeSettings"]
