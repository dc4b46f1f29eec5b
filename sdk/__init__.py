"""edgeinfer's runtime: load an export and generate with ONNX Runtime (no torch needed)."""

from .embedder import Embedder, Embeddings
from .engine import Engine
from .errors import (
    BusyError,
    CancelledRequestError,
    ConstraintError,
    ContextLengthError,
    EdgeInferError,
    ExportError,
    GenerationError,
    GraphError,
    ManifestError,
    ModelNotFoundError,
    NotAnExportError,
    ProviderError,
    SettingsError,
    UnavailableError,
)
from .manifest import FORMAT_VERSION, Manifest, load_manifest
from .pool import ModelPool
from .scheduler import Request, Scheduler
from .sequence import GenerationResult, Piece
from .settings import GenerationConfig

__all__ = [
    "Engine",
    "Embedder",
    "Embeddings",
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
    "ConstraintError",
    "ContextLengthError",
    "UnavailableError",
    "GenerationError",
    "GraphError",
    "ManifestError",
    "ModelNotFoundError",
    "NotAnExportError",
    "ProviderError",
    "SettingsError",
    "FORMAT_VERSION",
    "Manifest",
    "load_manifest",
]
