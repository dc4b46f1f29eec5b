"""Export: a Hugging Face causal LM → model.onnx (prefill and decode) + edgeinfer.json.
Needs the `edgeinfer[export]` extra (torch, transformers, optimum-onnx)."""
from .pipeline import ExportOptions, export_model

__all__ = ["ExportOptions", "export_model"]
