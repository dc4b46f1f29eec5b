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

That left 21 s, most of it lookups that walk the 7,400 nodes of the exported graph in Python once
per call: `nodes()`, `get_nodes_by_op_type()` and `input_name_to_nodes()` (2,300, 1,700 and 270
calls), and a rename of the inputs of every node for each useless Cast removed (250). `_Model`
answers them in single passes, keeps the readers of each name through the rotary pass (which
changes no node until it ends) and through the Cast pass (renamed with them), and skips the skip-
LayerNorm pass, and its shape inference, where the graph has no LayerNormalization: 11 s.

Whether this gives ORT's own result is pinned by a test (the same nodes, byte for byte, on a tiny
model of each fused family); the export checks every fused graph against PyTorch in any case.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

_INVALIDATING = (
    "add_node",
    "add_nodes",
    "remove_node",
    "remove_nodes",
    "replace_output_of_all_nodes",
    "update_graph",
    "prune_graph",
    "topological_sort",
    "remove_unused_constant",
    "remove_useless_cast_nodes",
    "remove_cascaded_cast_nodes",
    "clean_graph",
    "rename_graph_output",
    "add_prefix_to_names",
)


# The inputs that only matrix products and embedding lookups read: the weights, whose values no fusion needs.
_WEIGHT_INPUTS = {"MatMul": 1, "Gemm": 1, "Gather": 0}


# BertOnnxModel.optimize's passes in the order it runs them, for the progress line.
_PASSES = (
    "remove_useless_cast_nodes",
    "fuse_constant_fold",
    "fuse_layer_norm",
    "fuse_simplified_layer_norm",
    "fuse_gelu",
    "preprocess",
    "fuse_reshape",
    "fuse_skip_layer_norm",
    "fuse_skip_simplified_layer_norm",
    "fuse_rotary_embeddings",
    "fuse_attention",
    "fuse_shape",
    "postprocess",
    "fuse_bias_gelu",
    "fuse_add_bias_skip_layer_norm",
    "remove_unused_constant",
    "topological_sort",
)


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
        _readers = None  # input_name_to_nodes() held through the rotary pass, which changes no node until it ends
        _renamed = None  # the readers of each name, kept up to date through the useless-Cast pass's renames
        progress = staticmethod(lambda doing, fraction=None: None)

        def output_name_to_node(self, exclude_subgraphs=False):
            if exclude_subgraphs:
                return super().output_name_to_node(exclude_subgraphs)
            if self._outputs is None:
                self._outputs = super().output_name_to_node()
            return dict(self._outputs)  # a copy: some fusions edit the map they are given

        # The same answers as the base class's, for a graph without subgraphs (every decoder export),
        # from loops that run in C or over the node list once instead of through a call per node.
        def _flat(self):
            return len(self.graphs()) == 1

        def nodes(self):
            return list(self.model.graph.node) if self._flat() else super().nodes()

        def get_nodes_by_op_type(self, op_type):
            if not self._flat():
                return super().get_nodes_by_op_type(op_type)
            return [node for node in self.model.graph.node if node.op_type == op_type]

        def input_name_to_nodes(self, exclude_subgraphs=False):
            if not self._flat():
                return super().input_name_to_nodes(exclude_subgraphs)
            readers = {}
            for node in self.model.graph.node:
                for name in node.input:
                    if name:
                        readers.setdefault(name, []).append(node)
            return readers

        def get_graph_by_node(self, node):
            return self.model.graph if self._flat() else super().get_graph_by_node(node)

        def get_children(self, node, input_name_to_nodes=None, output_index=None):
            return super().get_children(node, input_name_to_nodes or self._readers, output_index)

        def fuse_rotary_embeddings(self, *args, **kwargs):
            # Its fusion asks get_children(), without a map, about every node of 60 paths: a walk over the
            # whole graph each time. Until it removes and adds nodes at its end (methods that forget the map
            # below), its fuse calls only collect nodes, so one map answers them all.
            self._readers = self.input_name_to_nodes()
            try:
                return super().fuse_rotary_embeddings(*args, **kwargs)
            finally:
                self._readers = None

        def fuse_skip_layer_norm(self, *args, **kwargs):
            # Its fusion starts from LayerNormalization nodes, after a symbolic shape inference of the whole
            # graph (a second on SmolLM2); RMS-norm models have none, and the pass would change nothing.
            if self._flat() and not self.get_nodes_by_op_type("LayerNormalization"):
                return None
            return super().fuse_skip_layer_norm(*args, **kwargs)

        def remove_node(self, node):
            if not self._flat():
                return super().remove_node(node)
            try:
                self.model.graph.node.remove(node)  # the base class first asks `node in graph.node`: a second walk
            except ValueError:
                super().remove_node(node)  # its warning

        def replace_input_of_all_nodes(self, old_input_name, new_input_name):
            if not self._flat():
                return super().replace_input_of_all_nodes(old_input_name, new_input_name)
            if self._renamed is None:
                readers = [node for node in self.model.graph.node if old_input_name in node.input]
            else:  # the nodes that read the name, and from now on read the new one
                readers = self._renamed.pop(old_input_name, [])
                self._renamed.setdefault(new_input_name, []).extend(readers)
            for node in readers:
                self.replace_node_input(node, old_input_name, new_input_name)

        def remove_useless_cast_nodes(self):
            # It renames the inputs of all nodes once per Cast it removes (253 on SmolLM2), each a walk
            # over the graph; a map of the readers of each name, renamed with them, finds the same nodes.
            # A Cast it removes stays among its input's readers, where renaming it again changes nothing.
            if self._flat():
                self._renamed = self.input_name_to_nodes()
            try:
                return super().remove_useless_cast_nodes()
            finally:
                self._renamed = None

    for name in _INVALIDATING:
        if hasattr(base, name):
            setattr(_Model, name, _forgetting(getattr(_Model, name)))
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
        self._outputs = self._readers = None
        try:
            return method(self, *args, **kwargs)
        finally:
            self._outputs = self._readers = None

    call.__name__ = method.__name__
    return call
