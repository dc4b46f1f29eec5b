"""ONNX Runtime's transformer optimizer (its Python fusions for GPT-2-like graphs), run on the
graph without its weights and without the optimizer's repeated walks over the whole graph.

Two things made the optimizer take 50 s of SmolLM2's export:
- its pattern matching asks the model for `output_name_to_node()` thousands of times, and each
  call walks all 5,000 nodes. `_Model` keeps that map until a node is added, removed or renamed
  through the model's methods; the map is of outputs only, which the fusions change through
  those methods.
- its symbolic shape inference (run five times) copies the model, weights and all. The graph is
  given to the optimizer without the tensors that only MatMul, Gemm and Gather read (the weight
  matrices and the embedding, of which the fusions and shape inference read only the shapes):
  they stay in the export's data file, referenced, and are read only where the attention rewrite
  packs them.

Whether this gives ORT's own result is pinned by a test (the same nodes, byte for byte, on a tiny
model of each fused family); the export checks every fused graph against PyTorch in any case.
"""
from __future__ import annotations

from pathlib import Path

import onnx
from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

_INVALIDATING = ("add_node", "add_nodes", "remove_node", "remove_nodes", "replace_output_of_all_nodes", "update_graph",
                 "prune_graph", "topological_sort", "remove_unused_constant", "remove_useless_cast_nodes",
                 "remove_cascaded_cast_nodes", "clean_graph", "rename_graph_output", "add_prefix_to_names")


# The inputs that only matrix products and embedding lookups read: the weights, whose values no fusion needs.
_WEIGHT_INPUTS = {"MatMul": 1, "Gemm": 1, "Gather": 0}


# BertOnnxModel.optimize's passes in the order it runs them, for the progress line.
_PASSES = ("remove_useless_cast_nodes", "fuse_constant_fold", "fuse_layer_norm", "fuse_simplified_layer_norm", "fuse_gelu",
           "preprocess", "fuse_reshape", "fuse_skip_layer_norm", "fuse_skip_simplified_layer_norm", "fuse_rotary_embeddings",
           "fuse_attention", "fuse_shape", "postprocess", "fuse_bias_gelu", "fuse_add_bias_skip_layer_norm",
           "remove_unused_constant", "topological_sort")


def load_without_weights(path: Path) -> onnx.ModelProto:
    """The graph at `path` with its weight matrices (what MatMul, Gemm and Gather read) left in its
    data file, referenced as `load_external_data=False` leaves them; its other tensors in memory."""
    model = onnx.load(str(path), load_external_data=False)
    weights = {n.input[_WEIGHT_INPUTS[n.op_type]] for n in model.graph.node
               if n.op_type in _WEIGHT_INPUTS and len(n.input) > _WEIGHT_INPUTS[n.op_type]}
    for tensor in model.graph.initializer:
        if uses_external_data(tensor) and tensor.name not in weights:
            load_external_data_for_tensor(tensor, str(path.parent))
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    return model


def optimize(model: onnx.ModelProto, num_heads: int, hidden_size: int, progress=lambda doing, fraction=None: None) -> onnx.ModelProto:
    """What `optimizer.optimize_model(model_type="gpt2", opt_level=0)` returns, changed in place;
    `progress` hears each fusion pass as it starts."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.onnx_model_gpt2 import Gpt2OnnxModel

    optimizer = _fast_model_class(Gpt2OnnxModel)(model, num_heads, hidden_size)
    optimizer.progress = progress
    optimizer.optimize(FusionOptions("gpt2"))
    optimizer.topological_sort()
    return optimizer.model


def _fast_model_class(base):
    class _Model(base):
        _outputs = None
        progress = staticmethod(lambda doing, fraction=None: None)

        def output_name_to_node(self, exclude_subgraphs=False):
            if exclude_subgraphs:
                return super().output_name_to_node(exclude_subgraphs)
            if self._outputs is None:
                self._outputs = super().output_name_to_node()
            return dict(self._outputs)  # a copy: some fusions edit the map they are given

    for name in _INVALIDATING:
        if hasattr(base, name):
            setattr(_Model, name, _forgetting(getattr(base, name)))
    for index, name in enumerate(_PASSES):
        if hasattr(base, name):
            setattr(_Model, name, _reported(getattr(_Model, name), name, index))
    return _Model


def _reported(method, name: str, index: int):
    def call(self, *args, **kwargs):
        self.progress(f"optimizer: {name.removeprefix('fuse_').replace('_', ' ')}", index / len(_PASSES))
        return method(self, *args, **kwargs)

    call.__name__ = name
    return call


def _forgetting(method):
    def call(self, *args, **kwargs):
        self._outputs = None
        try:
            return method(self, *args, **kwargs)
        finally:
            self._outputs = None

    call.__name__ = method.__name__
    return call
