"""The two ONNX graphs, made by optimum-onnx's exporter for the model's architecture:
prefill (the whole prompt, no past) and decode (one token on top of the KV cache)."""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import onnx

from edgeinfer.sdk.manifest import GraphSpec, KVSpec

PAST_PREFIX, PRESENT_PREFIX = "past_key_values.", "present."
GRAPHS = {"prefill": False, "decode": True}  # graph name → takes past inputs
_ONNX_TYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16"}


def export_graph(model, name: str, folder: Path) -> GraphSpec:
    """Export one graph into `folder` as NAME.onnx with its weights in NAME.onnx.data."""
    from optimum.exporters.onnx.convert import export
    from optimum.exporters.tasks import TasksManager

    constructor = TasksManager.get_exporter_config_constructor(
        "onnx", model, task="text-generation-with-past", library_name="transformers")
    onnx_config = constructor(model.config, use_past=True, use_past_in_inputs=GRAPHS[name])
    scratch = folder / f".{name}-scratch"
    scratch.mkdir()
    try:
        with warnings.catch_warnings():
            # The tracer's warnings about Python-side shape checks are expected for these
            # models; the export's validation stage is the real check of the graphs.
            warnings.simplefilter("ignore")
            export(model, onnx_config, scratch / f"{name}.onnx")
        graph = onnx.load(str(scratch / f"{name}.onnx"))  # with its weights, wherever optimum put them
        onnx.save(graph, str(folder / f"{name}.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=f"{name}.onnx.data", size_threshold=1024)
    finally:
        shutil.rmtree(scratch)
    return GraphSpec(file=f"{name}.onnx", inputs=[i.name for i in graph.graph.input],
                     outputs=[o.name for o in graph.graph.output])


def kv_layout(folder: Path, decode: GraphSpec) -> KVSpec:
    """The KV cache's layout, read off the decode graph's past inputs."""
    graph = onnx.load(str(folder / decode.file), load_external_data=False).graph
    past = [i for i in graph.input if i.name.startswith(PAST_PREFIX)]
    dims = past[0].type.tensor_type.shape.dim
    sequence_axis = next(k for k, d in enumerate(dims) if "past_sequence_length" in d.dim_param)
    static = [d.dim_value for k, d in enumerate(dims) if d.dim_value and k != sequence_axis]
    return KVSpec(
        num_layers=len(past) // 2,
        num_kv_heads=static[0],
        head_size=static[-1],
        dtype=_ONNX_TYPES[past[0].type.tensor_type.elem_type],
        sequence_axis=sequence_axis,
        past=[i.name for i in past],
        present=[PRESENT_PREFIX + i.name[len(PAST_PREFIX):] for i in past],
    )
