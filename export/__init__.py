"""Export: a Hugging Face causal LM → model.onnx (prefill and decode) + edgeinfer.json.
Needs the `edgeinfer[export]` extra (torch, transformers 5, onnx), imported at the first use of
what is exported below (the CLI reads `algorithms` without it)."""

import importlib

_WHERE = {"ExportOptions": "pipeline", "export_adapter": "pipeline", "export_model": "pipeline", "Quantization": "quantize"}

__all__ = ["ExportOptions", "Quantization", "export_adapter", "export_model"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
