"""export/pack.py: MatMuls that share an input packed into one MatMul and a Split, on hand-made
graphs run by ONNX Runtime (the family parity suite checks the packing on every real family)."""

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from edgeinfer.export.pack import pack_shared_inputs, packed_name
from edgeinfer.export.quantize import matmul_role, kept_int8


def _gated_mlp(hidden=8, inner=12, seed=0) -> onnx.ModelProto:
    """x -> SiLU(x @ gate) * (x @ up) @ down, named as optimum names a llama layer's MLP."""
    rng = np.random.default_rng(seed)
    weights = {
        name: rng.standard_normal(shape).astype(np.float32)
        for name, shape in (("gate", (hidden, inner)), ("up", (hidden, inner)), ("down", (inner, hidden)))
    }
    prefix = "/model/layers.3/mlp"
    nodes = [
        helper.make_node("MatMul", ["x", "gate"], ["g"], name=f"{prefix}/gate_proj/MatMul"),
        helper.make_node("MatMul", ["x", "up"], ["u"], name=f"{prefix}/up_proj/MatMul"),
        helper.make_node("Sigmoid", ["g"], ["s"]),
        helper.make_node("Mul", ["g", "s"], ["a"]),
        helper.make_node("Mul", ["a", "u"], ["h"]),
        helper.make_node("MatMul", ["h", "down"], ["y"], name=f"{prefix}/down_proj/MatMul"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", hidden])],
        [numpy_helper.from_array(array, name) for name, array in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_the_gate_and_up_projections_become_one_matmul_with_the_same_outputs():
    model = _gated_mlp()
    x = np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32)
    expected = _run(model, x)
    assert pack_shared_inputs(model) == 2
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
    assert [n.name for n in matmuls] == ["/model/layers.3/mlp/gate_up_proj/MatMul", "/model/layers.3/mlp/down_proj/MatMul"]
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert weights[matmuls[0].input[1]].shape == (8, 24)
    assert not {"gate", "up"} & set(weights)  # the parts' weights are gone
    split = next(n for n in model.graph.node if n.op_type == "Split")
    assert list(split.output) == ["g", "u"] and weights[split.input[1]].tolist() == [12, 12]
    np.testing.assert_array_equal(_run(model, x), expected)


def test_a_matmul_alone_or_on_a_computed_weight_is_left_as_it_was():
    model = _gated_mlp()
    model.graph.node[1].input[0] = "g2"  # up_proj now reads another tensor than gate_proj
    model.graph.node.insert(0, helper.make_node("Identity", ["x"], ["g2"]))
    before = onnx.ModelProto()
    before.CopyFrom(model)
    assert pack_shared_inputs(model) == 0
    assert model == before
    computed = _gated_mlp()  # up_proj's weight computed in the graph: not a constant to pack
    computed.graph.node[1].input[1] = "up_computed"
    computed.graph.node.insert(0, helper.make_node("Identity", ["up"], ["up_computed"]))
    assert pack_shared_inputs(computed) == 0 and sum(n.op_type == "MatMul" for n in computed.graph.node) == 3


def test_the_packed_module_is_named_for_keep_int8():
    assert packed_name(["/model/layers.3/mlp/gate_proj/MatMul", "/model/layers.3/mlp/up_proj/MatMul"]) == (
        "/model/layers.3/mlp/gate_up_proj/MatMul"
    )
    assert packed_name(["/h.0/mlp/fc_in/MatMul", "/h.0/mlp/fc_gate/MatMul"]) == "/h.0/mlp/fc_in_fc_gate/MatMul"
    names = [f"/model/layers.0/self_attn/{m}_proj/MatMul" for m in "qkv"]  # where attention.py leaves them apart
    assert packed_name(names) == "/model/layers.0/self_attn/qkv_proj/MatMul"
    assert matmul_role("/model/layers.3/mlp/gate_up_proj/MatMul") == (3, "gate_up_proj")
    model = _gated_mlp()
    pack_shared_inputs(model)
    assert kept_int8(model.graph, ["gate_up_proj:3"]) == ["/model/layers.3/mlp/gate_up_proj/MatMul"]
