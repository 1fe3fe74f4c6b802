"""Tensor side of the engine: the model runner.

What it shares with ``spec_decode/`` lives below both: the sampler
(``hybridllm_cloud/sampler.py``) and the KV cache with the input packing
(``model/kv_cache.py``).
"""
