"""The two ONNX graphs, made by optimum-onnx's exporter for the model's architecture:
prefill (the whole prompt, no past) and decode (one token on top of the KV cache)."""
from __future__ import annotations

import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import onnx

from edgeinfer.sdk.errors import ExportError
from edgeinfer.sdk.manifest import GraphSpec, KVSpec

from .families import onnx_config_constructor

PAST_PREFIX, PRESENT_PREFIX = "past_key_values.", "present."
GRAPHS = {"prefill": False, "decode": True}  # graph name → takes past inputs
# What tracing a model can raise (torch.onnx's own errors derive from RuntimeError).
_TRACE_ERRORS = (RuntimeError, ValueError, TypeError, KeyError, AttributeError, IndexError, NotImplementedError)
_ONNX_TYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16"}


def export_graph(model, name: str, folder: Path) -> GraphSpec:
    """Export one graph into `folder` as NAME.onnx with its weights in NAME.onnx.data."""
    from optimum.exporters.onnx.convert import export

    onnx_config = onnx_config_constructor(model)(model.config, use_past=True, use_past_in_inputs=GRAPHS[name])
    scratch = folder / f".{name}-scratch"
    scratch.mkdir()
    try:
        with warnings.catch_warnings(), _full_length_caches():
            # The tracer's warnings about Python-side shape checks are expected for these
            # models; the export's validation stage is the real check of the graphs.
            warnings.simplefilter("ignore")
            export(model, onnx_config, scratch / f"{name}.onnx")
    except _TRACE_ERRORS as e:
        raise ExportError(f"optimum-onnx could not export the {name} graph of this {model.config.model_type} model: "
                          f"{type(e).__name__}: {_first_line(e)}") from e
    try:
        graph = onnx.load(str(scratch / f"{name}.onnx"))  # with its weights, wherever optimum put them
        onnx.save(graph, str(folder / f"{name}.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=f"{name}.onnx.data", size_threshold=1024)
    finally:
        shutil.rmtree(scratch)
    return GraphSpec(file=f"{name}.onnx", inputs=[i.name for i in graph.graph.input],
                     outputs=[o.name for o in graph.graph.output])


@contextmanager
def _full_length_caches():
    """Every layer's cache keeps all its tokens while the graphs are traced.

    transformers 4.57 gives sliding-window layers a cache that keeps only the last window - 1
    tokens, so a prefill graph traced with it returns presents of different lengths per layer,
    which optimum-onnx 0.1.0's decode graph cannot take (it sizes the attention mask from one
    layer's past and fails, or attends to the wrong slots, once a prompt passes the window). With
    full-length caches the sliding window is still applied, by the attention mask, so the outputs
    are the same; the cost is that the cache of a sliding layer grows past its window.
    """
    from transformers import cache_utils

    original = cache_utils.DynamicCache.__init__

    def without_layer_types(self, ddp_cache_data=None, config=None, *args, **kwargs):
        original(self, ddp_cache_data, None, *args, **kwargs)

    cache_utils.DynamicCache.__init__ = without_layer_types
    try:
        yield
    finally:
        cache_utils.DynamicCache.__init__ = original


def kv_layout(folder: Path, decode: GraphSpec) -> KVSpec:
    """The KV cache's layout, read off the decode graph's past inputs."""
    graph = onnx.load(str(folder / decode.file), load_external_data=False).graph
    past = [i for i in graph.input if i.name.startswith(PAST_PREFIX)]
    key, value = (past[0].type.tensor_type.shape.dim, past[1].type.tensor_type.shape.dim)
    sequence_axis = next(k for k, d in enumerate(key) if "past_sequence_length" in d.dim_param)
    static = [d.dim_value for k, d in enumerate(key) if d.dim_value and k != sequence_axis]
    return KVSpec(
        num_layers=len(past) // 2,
        num_kv_heads=static[0],
        head_size=static[-1],
        value_head_size=value[-1].dim_value,
        dtype=_ONNX_TYPES[past[0].type.tensor_type.elem_type],
        sequence_axis=sequence_axis,
        past=[i.name for i in past],
        present=[PRESENT_PREFIX + i.name[len(PAST_PREFIX):] for i in past],
    )


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]
