"""Two tiny ONNX graphs that run on the logits where they are (on the GPU under CUDA), so the
full [batch, sequence, vocab] logits never have to come to the host:

- `last`: the last position's logits, [batch, vocab], for sampling on the host;
- `argmax`: the id of the largest logit at the last position, [batch], for greedy decoding;
- `tokens`: the id of the largest logit at every position, [batch, sequence], for checking the
  tokens speculative decoding proposed, all in one pass;
- `copy`: its input as its output, bound at addresses inside KV buffers to copy part of a row
  between host and device (the prefix cache where the buffers have no host view).

The graphs give logits for each row's last tokens only, so `last` is position -1 of every row.

The serialized heads ship with the package (head_graphs/), so loading an engine does not import
the onnx package; `python -m edgeinfer.sdk.heads` writes them again from `head_model`,
and a test checks that the files are what it builds.
"""

from __future__ import annotations

from pathlib import Path

FOLDER = Path(__file__).with_name("head_graphs")
TYPES = {1: "float", 10: "float16", 16: "bfloat16"}  # ONNX element types of logits
OPSET = 17
IR_VERSION = 8  # old enough for every onnxruntime edgeinfer supports


def head_model(kind: str, logits_type: int) -> bytes:
    """The serialized model of head `kind` ("last", "argmax", "tokens" or "copy") for logits of ONNX element type
    `logits_type` (float, float16, ...)."""
    from onnx import TensorProto, helper

    last_index = helper.make_tensor("last_index", TensorProto.INT64, [], [-1])
    nodes = [helper.make_node("Gather", ["logits", "last_index"], ["last"], axis=1)]
    if kind == "copy":
        nodes = [helper.make_node("Identity", ["x"], ["y"])]
        x = helper.make_tensor_value_info("x", logits_type, ["tokens", "width"])
        y = helper.make_tensor_value_info("y", logits_type, ["tokens", "width"])
        graph = helper.make_graph(nodes, "edgeinfer_copy", [x], [y])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION).SerializeToString()
    if kind == "tokens":
        nodes = [helper.make_node("ArgMax", ["logits"], ["tokens"], axis=-1, keepdims=0)]
        output = helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", "sequence"])
    elif kind == "argmax":
        nodes.append(helper.make_node("ArgMax", ["last"], ["argmax"], axis=-1, keepdims=0))
        output = helper.make_tensor_value_info("argmax", TensorProto.INT64, ["batch"])
    else:
        output = helper.make_tensor_value_info("last", logits_type, ["batch", "vocab"])
    logits = helper.make_tensor_value_info("logits", logits_type, ["batch", "sequence", "vocab"])
    graph = helper.make_graph(nodes, f"edgeinfer_{kind}", [logits], [output], initializer=[] if kind == "tokens" else [last_index])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
    return model.SerializeToString()


def head_file(kind: str, logits_type: int) -> Path:
    return FOLDER / f"{kind}_{TYPES[logits_type]}.onnx"


def load_head(kind: str, logits_type: int) -> bytes:
    """The serialized head, as shipped with the package."""
    return head_file(kind, logits_type).read_bytes()


if __name__ == "__main__":
    FOLDER.mkdir(exist_ok=True)
    for element_type in TYPES:
        for head in ("argmax", "last", "tokens", "copy"):
            head_file(head, element_type).write_bytes(head_model(head, element_type))
