"""Export: a Hugging Face causal LM → model.onnx (prefill and decode) + edgeinfer.json.
Needs the `edgeinfer[export]` extra (torch, transformers 5, onnx)."""

from .pipeline import ExportOptions, export_adapter, export_model
from .quantize import Quantization

__all__ = ["ExportOptions", "Quantization", "export_adapter", "export_model"]
