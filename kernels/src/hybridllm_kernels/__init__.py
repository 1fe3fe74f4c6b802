"""hybridllm Triton kernels for the cloud engine, each with a plain-torch reference.

The engine calls them only through :mod:`hybridllm_kernels.ops`, which picks Triton on CUDA
devices and the references in :mod:`hybridllm_kernels.reference` elsewhere. See docs/kernels.md.
"""
