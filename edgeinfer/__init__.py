"""edgeinfer: causal language models on edge boxes through ONNX Runtime.

The package maps its parts from the repository's folders: `edgeinfer.sdk` (runtime),
`edgeinfer.export` (Hugging Face → ONNX), `edgeinfer.cli` and `edgeinfer.models` (catalog).
"""
from edgeinfer.sdk import EdgeInferError, Engine, GenerationConfig, GenerationResult, Piece

__version__ = "0.1.0"
__all__ = ["Engine", "GenerationConfig", "GenerationResult", "Piece", "EdgeInferError", "__version__"]
