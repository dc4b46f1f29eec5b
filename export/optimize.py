"""ONNX Runtime's transformer optimizer (its Python fusions for GPT-2-like graphs), run on the
graph without its weights and with lookups that answer in one pass.

- Its symbolic shape inference (run several times) copies the model, weights and all, so the graph
  is given to it without the tensors that only MatMul, Gemm and Gather read (the weight matrices and
  the embedding, of which the fusions and shape inference read only the shapes): they stay in the
  export's data file, referenced, and are read only where the attention rewrite packs them.
- Its pattern matching asks the model for the readers and writers of names and the nodes of a type
  thousands of times, each a walk of the whole graph in Python: `patches.fast_model_class` answers
  them from maps built once, forgotten whenever a node changes.

A test pins the result to ORT's own (the same nodes, byte for byte, on a tiny model of each fused
family); the export checks every fused graph against PyTorch in any case.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

from .patches import fast_model_class, scalar_quick_gelu_only, state_op_shapes, weighted_norms_only
from .stream import is_deferred

# The inputs that only matrix products and embedding lookups read: the weights, whose values no fusion needs.
_WEIGHT_INPUTS = {"MatMul": 1, "Gemm": 1, "Gather": 0}


def load_without_weights(path: Path) -> onnx.ModelProto:
    """The graph at `path` with its weight matrices (what MatMul, Gemm and Gather read) left in its
    data file, referenced as `load_external_data=False` leaves them; its other tensors in memory."""
    model = onnx.load(str(path), load_external_data=False)
    weights = {
        n.input[_WEIGHT_INPUTS[n.op_type]]
        for n in model.graph.node
        if n.op_type in _WEIGHT_INPUTS and len(n.input) > _WEIGHT_INPUTS[n.op_type]
    }
    for tensor in model.graph.initializer:
        if uses_external_data(tensor) and tensor.name not in weights and not is_deferred(tensor):
            load_external_data_for_tensor(tensor, str(path.parent))
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    return model


def optimize(model: onnx.ModelProto, num_heads: int, hidden_size: int, progress=lambda doing, fraction=None: None) -> onnx.ModelProto:
    """What `optimizer.optimize_model(model_type="gpt2", opt_level=0)` returns, changed in place;
    `progress` hears each fusion pass as it starts."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.onnx_model_gpt2 import Gpt2OnnxModel

    with state_op_shapes(), weighted_norms_only(), scalar_quick_gelu_only():
        optimizer = fast_model_class(Gpt2OnnxModel)(model, num_heads, hidden_size)
        optimizer.progress = progress
        optimizer.optimize(FusionOptions("gpt2"))
    optimizer.topological_sort()
    return optimizer.model
