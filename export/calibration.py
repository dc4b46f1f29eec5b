"""What a quantizer learns from a calibration text: the inputs each MatMul of the fp32 export sees
over it. The export's own graph runs the text (windows of `WINDOW` tokens, each from an empty
cache, as the quality measure does) with every MatMul's input added as an output; each input's
rows are kept on disk (float16, one file per input) so that a large model's activations never
sit in memory together, and read back when its MatMuls are quantized: their channels' mean
square (llama.cpp's importance matrix) for k_quant, their product X^T X (the Hessian of the
layer's error) for GPTQ."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from edgeinfer.sdk.errors import ExportError
from edgeinfer.sdk.cache_kinds import cache_kinds
from edgeinfer.sdk.manifest import load_manifest
from edgeinfer.sdk.runtime import Graph
from edgeinfer.sdk.tokenizer import Tokenizer

from .graphs import GRAPH_FILE

# The default calibration text: chat turns, tool calls, code, prose, lists and worked problems, in
# several languages (about 4,800 tokens for SmolLM2). Neither text the quality is scored on
# (quality_text.txt, held_text.txt) is in it.
CALIBRATION_TEXT = Path(__file__).with_name("calibration_text.txt")
WINDOW = 256
_GRAPH = "calibration.onnx"  # the export's graph with the MatMuls' inputs as outputs, while it runs


class Activations:
    """The rows each MatMul input took over the calibration text, by input name, in `folder`."""

    def __init__(self, folder: Path, names: list[str]):
        self.folder, self.names = Path(folder), names

    def rows(self, name: str) -> np.ndarray | None:
        """[tokens, channels] float32, or None for an input the text did not reach."""
        path = self.folder / _file(self.names, name)
        return np.load(path).astype(np.float32) if name in self.names and path.exists() else None

    def importance(self, name: str) -> np.ndarray | None:
        rows = self.rows(name)
        return None if rows is None else np.mean(rows * rows, axis=0)

    def hessian(self, name: str) -> np.ndarray | None:
        rows = self.rows(name)
        return None if rows is None else (rows.T @ rows) / len(rows)


def collect(export: Path, text: str, scratch: Path) -> Activations:
    """Run the fp32 export in `export` over `text` and keep each MatMul input's rows in `scratch`."""
    manifest = load_manifest(export)
    ids = Tokenizer(export, manifest.tokenizer).encode(text)
    if len(ids) < 2:
        raise ExportError("the calibration text is empty: give --calibration a file of the text the model will see")
    element = onnx.TensorProto.FLOAT16 if manifest.kv.dtype == "float16" else onnx.TensorProto.FLOAT
    names = _matmul_inputs(export / GRAPH_FILE, export / _GRAPH, element)
    scratch.mkdir(parents=True, exist_ok=True)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
    try:
        graph = Graph(export / _GRAPH, "cpu", None)
        for start in range(0, len(ids), WINDOW):
            window = ids[start : start + WINDOW]
            _, outputs = graph.run(window_feeds(graph, manifest, window), on_device=[], to_host=names)
            for name in names:
                parts[name].append(_stored(outputs[name].reshape(-1, outputs[name].shape[-1])))
    finally:
        (export / _GRAPH).unlink(missing_ok=True)
    for name, rows in parts.items():
        np.save(scratch / _file(names, name), np.concatenate(rows))
    return Activations(scratch, names)


def _matmul_inputs(source: Path, target: Path, element: int) -> list[str]:
    """The activations MatMuls with a constant weight read, written as outputs of a copy of the graph."""
    model = onnx.load(str(source), load_external_data=False)
    constants = {t.name for t in model.graph.initializer}
    names = list(dict.fromkeys(n.input[0] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in constants))
    outputs = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.helper.make_tensor_value_info(name, element, None) for name in names if name not in outputs)
    onnx.save(model, str(target))
    return names


def window_feeds(graph: Graph, manifest, window: list[int], logits: int = 1) -> dict[str, np.ndarray]:
    """One window from an empty cache, with the logits of its last `logits` positions: a slot cache
    (written in place) as long as the window, or a growing cache's empty past, and zero states."""
    kv = manifest.kv
    feeds = {
        "input_ids": np.array([window], np.int64),
        "attention_mask": np.ones((1, len(window)), np.int64),
        "logits_to_keep": np.array(logits, np.int64),
    }
    feeds = {name: value for name, value in feeds.items() if name in graph.inputs}
    if "position_ids" in graph.inputs:  # [1, sequence], or [3, 1, sequence] for 3-D rotary (text: three equal rows)
        axes = len(graph.inputs["position_ids"].shape)
        feeds["position_ids"] = np.broadcast_to(np.arange(len(window), dtype=np.int64), (3,) * (axes - 2) + (1, len(window))).copy()
    if "image_features" in graph.inputs:  # a vision-language model's text windows: no image features
        feeds["image_features"] = np.zeros((0, manifest.vision["hidden_size"]), graph.input_dtype("image_features"))
    length = len(window) if kv.in_place else 0
    dtype = np.float16 if kv.dtype == "float16" else np.float32
    declared = {name: value.shape for name, value in graph.inputs.items()}
    for kind in cache_kinds(kv, length):  # every buffer empty, a recurrent state at zero, as the runtime's
        feeds.update(
            {name: np.zeros(shape, dtype) for name, shape in kind.buffer_shapes(1, length, declared, kv.sequence_axis).items()}
        )
    return feeds


def _stored(rows: np.ndarray) -> np.ndarray:
    """float16 where it holds the values (half the disk), else float32."""
    return rows.astype(np.float16) if np.abs(rows).max(initial=0) < 6e4 else rows


def _file(names: list[str], name: str) -> str:
    return f"{names.index(name):04d}.npy"
