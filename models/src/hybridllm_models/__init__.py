"""hybridllm model store and format conversion (GGUF, safetensors, ONNX); the store needs no torch.

Public API::

    import hybridllm_models
    path = hybridllm_models.ensure()  # HF folder (fp32) of the default model
    gguf = hybridllm_models.ensure(target="gguf-q4_k_m")  # a .gguf file
    onnx = hybridllm_models.ensure("file:///models/x.gguf", "onnx")  # folder with model.onnx

Importing this package imports neither torch nor onnx; conversions import them when they run.
"""

from hybridllm_models.convert import TARGETS, ensure, ensure_artifact
from hybridllm_models.errors import (
    ConversionError,
    IntegrityError,
    ModelStoreError,
    SourceNotFoundError,
    UnknownSchemeError,
)
from hybridllm_models.store import Artifact, Store, default_root
from hybridllm_models.uri import DEFAULT_URI

__all__ = [
    "DEFAULT_URI",
    "TARGETS",
    "Artifact",
    "ConversionError",
    "IntegrityError",
    "ModelStoreError",
    "SourceNotFoundError",
    "Store",
    "UnknownSchemeError",
    "default_root",
    "ensure",
    "ensure_artifact",
]
