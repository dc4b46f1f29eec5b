"""edgeinfer: causal language models on edge boxes through ONNX Runtime.

The package maps its parts from the repository's folders: `edgeinfer.sdk` (runtime),
`edgeinfer.export` (Hugging Face → ONNX), `edgeinfer.cli` and `edgeinfer.models` (catalog).
"""

from edgeinfer.sdk import (
    BusyError,
    CancelledRequestError,
    ConstraintError,
    ContextLengthError,
    EdgeInferError,
    Embedder,
    Embeddings,
    Engine,
    ExportError,
    GenerationConfig,
    GenerationError,
    GenerationResult,
    GraphError,
    ManifestError,
    ModelNotFoundError,
    ModelPool,
    NotAnExportError,
    Piece,
    ProviderError,
    Request,
    Scheduler,
    SettingsError,
    UnavailableError,
)

__version__ = "0.1.0"
__all__ = [
    "Embedder",
    "Embeddings",
    "Engine",
    "ModelPool",
    "Scheduler",
    "Request",
    "BusyError",
    "CancelledRequestError",
    "GenerationConfig",
    "GenerationResult",
    "Piece",
    "EdgeInferError",
    "ExportError",
    "GenerationError",
    "GraphError",
    "ManifestError",
    "ModelNotFoundError",
    "NotAnExportError",
    "ProviderError",
    "SettingsError",
    "ConstraintError",
    "ContextLengthError",
    "UnavailableError",
    "__version__",
]
