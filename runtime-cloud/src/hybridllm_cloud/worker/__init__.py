"""Tensor side of the engine: the model runner and the sampler."""
