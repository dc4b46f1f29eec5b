"""MatMuls that read the same input through constant weights become one MatMul: the weights side by
side along the output axis, then a Split back into the tensors the rest of the graph reads. In a
gated MLP that is the gate and the up projection (the attention's q, k and v are packed by
attention.py, for GroupQueryAttention's packed input). A decode step then runs fewer, wider
kernels; a kernel's cost has a fixed part per call, and a quantized MatMul's cost grows little
with its width. The outputs are the same numbers: each output column is computed as before.

The packed MatMul is named after its parts, so that quantization reads its layer and module off
the name as for any other (`/model/layers.3/mlp/gate_up_proj/MatMul`)."""

from __future__ import annotations

import collections
import os

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .attention_pattern import GraphView
from .graphs import drop_unused_initializers


def pack_shared_inputs(model: onnx.ModelProto, weights_from=None) -> int:
    """Pack every group of MatMuls that share an input and have 2-D constant weights of one type;
    returns the number of MatMuls packed. Weights the model keeps in a data file are read from the
    folder `weights_from`."""
    graph = model.graph
    view = GraphView(graph, weights_from)
    groups = _groups(graph, view)
    for matmuls in groups:
        _pack(graph, view, matmuls)
    drop_unused_initializers(graph)  # the parts' weights
    return sum(len(group) for group in groups)


def packed_name(names: list[str]) -> str:
    """The packed MatMul's name: the parts' common path with their modules joined
    (/model/layers.3/mlp/gate_proj/MatMul and .../up_proj/MatMul: /model/layers.3/mlp/gate_up_proj/MatMul;
    q_proj, k_proj and v_proj: qkv_proj, as attention.py names the projections it packs)."""
    paths = [[part for part in name.split("/") if part and part != "MatMul"] for name in names]
    common = os.path.commonprefix(paths)
    modules = ["_".join(path[len(common) :]) or "matmul" for path in paths]
    if all(module.endswith("_proj") for module in modules):
        parts = [module.removesuffix("_proj") for module in modules]
        joined = ("" if all(len(part) == 1 for part in parts) else "_").join(parts) + "_proj"  # qkv_proj, gate_up_proj
    else:
        joined = "_".join(modules)
    return "/" + "/".join([*common, joined, "MatMul"])


def _groups(graph, view: GraphView) -> list[list]:
    """The MatMuls to pack, grouped by their shared input, in graph order."""
    by_input = collections.defaultdict(list)
    for node in graph.node:
        weight = view.constants.get(node.input[1]) if node.op_type == "MatMul" else None
        if weight is not None and len(weight.dims) == 2 and node.input[0] not in view.constants:
            by_input[(node.input[0], weight.dims[0], weight.data_type)].append(node)
    return [group for group in by_input.values() if len(group) > 1]


def _pack(graph, view: GraphView, matmuls: list) -> None:
    weights = [view.constants[m.input[1]] for m in matmuls]
    name = packed_name([m.name for m in matmuls])
    weight, packed, sizes = f"{name}.weight", f"{name}_output", f"{name}_sizes"
    graph.initializer.append(view.joined(weights, weight))
    graph.initializer.append(numpy_helper.from_array(np.array([w.dims[1] for w in weights], np.int64), sizes))
    position = min(list(graph.node).index(m) for m in matmuls)
    for m in matmuls:
        graph.node.remove(m)
    outputs = [m.output[0] for m in matmuls]
    graph.node.insert(position, helper.make_node("MatMul", [matmuls[0].input[0], weight], [packed], name=name))
    graph.node.insert(position + 1, helper.make_node("Split", [packed, sizes], outputs, name=f"{name}_split", axis=-1))
