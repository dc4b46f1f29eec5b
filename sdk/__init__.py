"""edgeinfer's runtime: load an export and generate with ONNX Runtime (no torch needed)."""
from .engine import Engine, GenerationResult, Piece
from .errors import (EdgeInferError, ExportError, GenerationError, ManifestError, ModelNotFoundError,
                     NotAnExportError, ProviderError)
from .manifest import FORMAT_VERSION, Manifest, load_manifest

__all__ = ["Engine", "GenerationResult", "Piece", "EdgeInferError", "ExportError", "GenerationError",
           "ManifestError", "ModelNotFoundError", "NotAnExportError", "ProviderError", "FORMAT_VERSION",
           "Manifest", "load_manifest"]
