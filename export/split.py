"""The split layout (`edgeinfer export --graphs split`): the export's one graph made into the two
graphs the design names, for runtimes and accelerators that want each phase's shapes fixed.

- `prefill.onnx` takes the prompt and no past: each past input becomes an empty tensor made inside
  the graph, so its presents hold the prompt's keys and values alone. With `prefill_length`, its
  token inputs have that fixed length (the runtime pads a prompt to it).
- `decode.onnx` is the one graph as it was: new tokens on top of the past. With `static_context`,
  its past inputs and presents have that fixed capacity, its attention mask that width, and it
  takes one token per row (only a graph that writes its cache in place can: `kv.in_place`).

Both keep every token in every layer: a sliding layer's cache that keeps only its window
(`kv.windows`) would give the prefill graph no past to evict from, so the split turns it off.

Both read the same weights file, `weights.data`: the split costs no second copy on disk.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper
from onnx.external_data_helper import uses_external_data

from edgeinfer.sdk.errors import ExportError
from edgeinfer.sdk.manifest import SPLIT_FORMAT_VERSION, GraphSpec, KVSpec, Manifest, describe_files

from .graphs import GRAPH_FILE
from .validate import RELATIVE_TOLERANCE

PREFILL_FILE, DECODE_FILE, WEIGHTS_FILE = "prefill.onnx", "decode.onnx", "weights.data"
_TOKEN_INPUTS = ("input_ids", "position_ids")
_BATCH = "edgeinfer_prefill_batch"


def split_export(folder: Path, manifest: Manifest, prefill_length: int | None, static_context: int | None) -> tuple[Manifest, dict]:
    """Split the export in `folder` (its manifest saved) and check the two graphs against the one:
    the same prompts, a batch, and prompts shorter and longer than `prefill_length`, through the
    runtime. Returns the new manifest (saved) and the comparison; raises where they differ."""
    if manifest.kv.state:
        raise ExportError(
            "--graphs split does not take a model with recurrent state (linear attention) yet: its prefill graph would "
            "need the state's inputs; export with the default layout (one graph)"
        )
    if static_context is not None and not manifest.kv.in_place:
        raise ExportError(
            "--static-context needs a graph that writes its KV cache in place (GroupQueryAttention), and this "
            "export keeps the attention as traced, whose cache grows every step: export without "
            "--static-context (the decode graph's context is then dynamic)"
        )
    if static_context is not None and static_context > manifest.max_context:
        raise ExportError(
            f"--static-context {static_context} is more than the export's context of {manifest.max_context} "
            f"tokens: pass at most {manifest.max_context}"
        )
    context = min(manifest.max_context, static_context or manifest.max_context)
    prompts = _parity_prompts(manifest.vocab_size, context, prefill_length)
    single = _outputs(folder, prompts, context)
    gc.collect()  # the engine's sessions go before the next ones load
    prefill, decode = split_graphs(folder, manifest.kv, prefill_length, static_context)
    manifest = dataclasses.replace(
        manifest,
        kv=dataclasses.replace(manifest.kv, windows=[]),
        graph=decode,
        prefill=prefill,
        prefill_length=prefill_length,
        static_context=static_context,
        max_context=context,
        format_version=max(manifest.format_version, SPLIT_FORMAT_VERSION),
    )
    if manifest.files:  # a finished export split afterwards: its files are now others
        manifest = dataclasses.replace(manifest, files=describe_files(folder))
    manifest.save(folder)
    split = _outputs(folder, prompts, context)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(single["logits"], split["logits"]))
    tolerance = RELATIVE_TOLERANCE[manifest.dtype] * max(1.0, max(float(np.abs(a).max()) for a in single["logits"]))
    result = {
        "max_abs_diff": worst,
        "tolerance": tolerance,
        "tokens_equal": single["tokens"] == split["tokens"],
        "prompt_tokens": [len(p) for p in prompts],
    }
    if not result["tokens_equal"] or worst > tolerance:
        raise ExportError(
            f"the split graphs do not compute what the one graph does (largest logits difference {worst:.3g}, "
            f"tolerance {tolerance:.3g}; greedy tokens {'equal' if result['tokens_equal'] else 'differ'}): "
            "this is a bug in edgeinfer, please report it; the default layout (--graphs single) is unaffected"
        )
    return manifest, result


def _parity_prompts(vocab: int, context: int, prefill_length: int | None) -> list[list[int]]:
    """Token ids (any ids serve: both layouts get the same) for a short prompt (at most half the
    context, so that decode steps follow it) and, where the context has room, one longer than the
    prefill graph's fixed length."""
    lengths = [max(1, min(9, prefill_length or 9, context // 2))]
    if prefill_length is not None and prefill_length + 3 + 8 <= context:
        lengths.append(prefill_length + 3)
    return [[(7 * i + 3) % vocab for i in range(n)] for n in lengths]


def _outputs(folder: Path, prompts: list[list[int]], context: int) -> dict:
    """The runtime's logits (each prompt's prefill, then up to 4 greedy decode steps, as the
    context allows) and greedy tokens (each prompt alone and, for the first, in a batch with its
    start) on the CPU, within `context` tokens (the split layout's, for both)."""
    from edgeinfer.sdk.engine import Engine
    from edgeinfer.sdk.settings import GenerationConfig

    engine = Engine.load(folder, provider="cpu", prefix_cache=0, max_context=context)
    logits, tokens = [], []
    greedy = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    for ids in prompts:
        cache = engine.runner.new_batch()
        step = engine.runner.prefill(cache, [ids]).numpy()[0, -1].astype(np.float32)
        logits.append(step)
        for _ in range(min(4, engine.max_context - len(ids))):
            step = engine.runner.decode(cache, [int(np.argmax(step))]).numpy()[0, -1].astype(np.float32)
            logits.append(step)
        tokens.append(engine.generate(ids, greedy).token_ids)
    short = prompts[0][: max(1, len(prompts[0]) // 3)]
    tokens += [r.token_ids for r in engine.generate_batch([short, prompts[0]], greedy)]
    return {"logits": logits, "tokens": tokens}


def split_graphs(
    folder: Path, kv: KVSpec, prefill_length: int | None = None, static_context: int | None = None
) -> tuple[GraphSpec, GraphSpec]:
    """Write prefill.onnx and decode.onnx from the folder's model.onnx (which goes), both reading
    weights.data (model.onnx.data renamed); returns their specs."""
    folder = Path(folder)
    decode = onnx.load(str(folder / GRAPH_FILE), load_external_data=False)
    _point_weights_at(decode.graph, WEIGHTS_FILE)
    whole_windows(decode.graph)
    prefill = copy.deepcopy(decode)
    _without_past(prefill.graph, kv)
    if prefill_length is not None:
        _fix_token_axis(prefill.graph, prefill_length)
    if static_context is not None:
        _fix_decode(decode.graph, kv, static_context)
    (folder / f"{GRAPH_FILE}.data").replace(folder / WEIGHTS_FILE)
    (folder / GRAPH_FILE).unlink()
    for model, name in ((prefill, PREFILL_FILE), (decode, DECODE_FILE)):
        onnx.save(model, str(folder / name))
    return _spec(prefill, PREFILL_FILE), _spec(decode, DECODE_FILE)


def _spec(model: onnx.ModelProto, file: str) -> GraphSpec:
    return GraphSpec(file=file, inputs=[i.name for i in model.graph.input], outputs=[o.name for o in model.graph.output])


def _point_weights_at(graph: onnx.GraphProto, location: str) -> None:
    for tensor in graph.initializer:
        if uses_external_data(tensor):
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = location


def whole_windows(graph: onnx.GraphProto) -> None:
    """Sliding layers keep every token (their attention still reads only the window)."""
    for node in graph.node:
        for attribute in node.attribute:
            if node.op_type == "GroupQueryAttention" and attribute.name == "sliding_window_cache":
                attribute.i = 0


def _without_past(graph: onnx.GraphProto, kv: KVSpec) -> None:
    """Each past input becomes an empty tensor of its shape (zero positions, the batch of
    input_ids), made by the graph; the presents' cache axis is then the prompt's length."""
    inputs = {i.name: i for i in graph.input}
    nodes = [
        helper.make_node("Shape", ["input_ids"], [f"{_BATCH}_shape"]),
        helper.make_node("Gather", [f"{_BATCH}_shape", f"{_BATCH}_zero"], [_BATCH], axis=0),
    ]
    graph.initializer.append(helper.make_tensor(f"{_BATCH}_zero", TensorProto.INT64, [1], [0]))
    for k, name in enumerate(kv.past):
        declared = inputs[name].type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in declared.shape.dim]
        if sum(d is None for d in dims) != 2 or dims[0] is not None or dims[kv.sequence_axis] is not None:
            raise ExportError(f"past input {name} has shape {dims}, not [batch, ..., past positions, ...] as the split expects")
        rest = helper.make_tensor(
            f"edgeinfer_prefill_shape_{k}",
            TensorProto.INT64,
            [len(dims) - 1],
            [0 if axis == kv.sequence_axis else d for axis, d in enumerate(dims) if axis],
        )
        graph.initializer.append(rest)
        zero = helper.make_tensor("value", declared.elem_type, [1], [0])
        nodes += [
            helper.make_node("Concat", [_BATCH, rest.name], [f"{rest.name}_full"], axis=0),
            helper.make_node("ConstantOfShape", [f"{rest.name}_full"], [name], value=zero),
        ]
        graph.input.remove(inputs[name])
    for position, node in enumerate(nodes):
        graph.node.insert(position, node)
    for output in graph.output:
        if output.name in kv.present:
            axis = output.type.tensor_type.shape.dim[kv.sequence_axis]
            axis.Clear()
            axis.dim_param = "sequence_length"


def _fix_token_axis(graph: onnx.GraphProto, length: int) -> None:
    """The prompt's inputs take exactly `length` positions."""
    for value in graph.input:
        if value.name in (*_TOKEN_INPUTS, "attention_mask"):
            _set_dim(value, 1, length)


def _fix_decode(graph: onnx.GraphProto, kv: KVSpec, capacity: int) -> None:
    """One token per row, on a cache of `capacity` slots; the attention mask spans them all."""
    for value in [*graph.input, *graph.output]:
        if value.name in (*kv.past, *kv.present):
            _set_dim(value, kv.sequence_axis, capacity)
        elif value.name in _TOKEN_INPUTS:
            _set_dim(value, 1, 1)
        elif value.name == "attention_mask":
            _set_dim(value, 1, capacity)


def _set_dim(value: onnx.ValueInfoProto, axis: int, size: int) -> None:
    dim = value.type.tensor_type.shape.dim[axis]
    dim.Clear()
    dim.dim_value = size
