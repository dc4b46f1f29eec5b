"""The model's ONNX graph, traced by torch.onnx through export/trace.py, and saved with its weights apart.

One graph does both phases: it takes the KV cache as `past_key_values.*` inputs, so prefill is
the graph run over the whole prompt with an empty past (zero tokens), and decode is the graph run
for one new token on top of the past. One graph means one session: one copy of the weights in memory, one set of pre-packed weights, and half the
load time of two.

After export the graph computes logits for the last `logits_to_keep` positions only (an int64
scalar input; the runtime passes 1): a prompt's other positions would cost a [batch, prompt, vocab]
product that nothing reads (a fifth of prefill's arithmetic on SmolLM2). Speculative decoding
verifies k proposed tokens in one pass and passes k + 1.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import helper
from onnx.external_data_helper import uses_external_data

from edgeinfer.sdk.errors import ExportError
from edgeinfer.sdk.manifest import GraphSpec, KVSpec

from .patches import onnx_float, weights_apart
from .source import first_line
from . import stream
from .stream import FoldedWeight, hollow_weights, is_deferred, made, streamed
from .trace import PAST_PREFIX, PRESENT_PREFIX, is_state, trace, trace_hidden

GRAPH_FILE = "model.onnx"
LAST_POSITION_NODE = "edgeinfer_last_position"  # the Slice before the lm_head (attention.py replaces it)
LOGITS_TO_KEEP = "logits_to_keep"  # the graph input: how many of the last positions get logits
# What tracing a model can raise (torch.onnx's own errors derive from RuntimeError).
_TRACE_ERRORS = (RuntimeError, ValueError, TypeError, KeyError, AttributeError, IndexError, NotImplementedError)
_ONNX_TYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16"}
# Ops between the lm_head MatMul and the logits that act on each position alone (softcapping, scaling).
_POSITIONWISE = {"Mul", "Div", "Tanh", "Add", "Cast", "Identity"}


def export_graph(model, folder: Path, defer: bool = False) -> GraphSpec:
    """Export the graph into `folder` as model.onnx, its weights in model.onnx.data: traced with
    its matrices hollow, then written from the loaded model one at a time (export/stream.py), so
    that the model may be loaded in its checkpoint's precision and no fp32 copy is ever whole.
    `defer`: the matrices are not written but deferred (`stream.defer`), inside `stream.deferring`."""
    return _exported(model, folder, trace, f"this {model.config.model_type} model", defer)


def export_hidden_graph(base, folder: Path) -> GraphSpec:
    """Export the graph of `base` (a model without its lm_head) into `folder` as model.onnx: token
    ids, attention mask (and positions) in, `last_hidden_state` [batch, positions, hidden] out, no
    KV cache (an embedding model reads each text once)."""
    return _exported(base, folder, trace_hidden, f"this {base.config.model_type} model's hidden states")


def _exported(model, folder: Path, tracer, what: str, defer: bool = False) -> GraphSpec:
    """Trace `model` with `tracer` into a scratch folder, its weights written apart one at a time,
    then save the graph into `folder` (the generation graph with its logits for the last positions).
    Where the trace folds a large matrix into a constant (LongCat-Flash's), which a hollow matrix
    cannot give, a model loaded in fp32 is traced again with its matrices as they are; one loaded in
    its checkpoint's precision (a streamed export) is refused."""
    import torch

    try:
        return _traced_into(model, folder, tracer, what, defer, hollow=True)
    except FoldedWeight:
        if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
            raise
        return _traced_into(model, folder, tracer, what, defer, hollow=False)


def _traced_into(model, folder: Path, tracer, what: str, defer: bool, hollow: bool) -> GraphSpec:
    scratch = folder / ".scratch"
    scratch.mkdir()
    try:
        with weights_apart() as weights:
            with hollow_weights(model, enabled=hollow) as hollowed:
                tracer(model, scratch / GRAPH_FILE)
            write_weights(scratch / GRAPH_FILE, streamed(weights, hollowed), defer)
            weights.clear()
        graph = onnx.load(str(scratch / GRAPH_FILE), load_external_data=False)  # its weights stay in their files
        if tracer is trace:
            last_position_logits(graph.graph)
        if (scratch / f"{GRAPH_FILE}.data").exists():  # the weights as written: moved, not copied
            (scratch / f"{GRAPH_FILE}.data").replace(folder / f"{GRAPH_FILE}.data")
        save_graph(graph, folder, append=True)
    except _TRACE_ERRORS as e:
        raise ExportError(f"torch.onnx could not export {what}: {type(e).__name__}: {first_line(e)}") from e
    finally:
        shutil.rmtree(scratch)
    return GraphSpec(file=GRAPH_FILE, inputs=[i.name for i in graph.graph.input], outputs=[o.name for o in graph.graph.output])


def drop_unused_initializers(graph: onnx.GraphProto) -> None:
    """Remove the initializers no node reads (weights a rewrite replaced)."""
    used = {name for node in graph.node for name in node.input}
    for tensor in [t for t in graph.initializer if t.name not in used]:
        graph.initializer.remove(tensor)


def save_graph(
    model: onnx.ModelProto, folder: Path, weights_from: Path | None = None, append: bool = False, make: bool = False
) -> None:
    """Write `model` as the export's graph: model.onnx, its tensors of 1 KiB or more in
    model.onnx.data. Tensors the model still references in a data file (it was loaded without
    them) are copied from `weights_from`'s, one at a time, so that the weights need not all be in
    memory; the data file written holds the graph's tensors and nothing else. The model's tensors
    then reference the new file. `append`: `folder`'s data file is kept, the tensors it holds stay
    where they are, and the others are added at its end (no copy of the weights already there).
    Deferred weights (export/stream.py) stay deferred, or are made and written with `make`."""
    folder = Path(folder)
    data, partial = folder / f"{GRAPH_FILE}.data", folder / f".{GRAPH_FILE}.data.partial"
    target = data if append else partial
    sources = {}
    try:
        with open(target, "ab" if append else "wb") as out:
            for tensor in _graph_tensors(model.graph):
                if append and uses_external_data(tensor) and _external(tensor)["location"] == data.name:
                    continue
                raw = _tensor_bytes(tensor, folder if append else weights_from, sources, make)
                if raw is not None:
                    stream.refer(tensor, data.name, out.tell(), len(raw))
                    out.write(raw)
    finally:
        for handle in sources.values():
            handle.close()
    if not append:
        partial.replace(data)
    onnx.save(model, str(folder / GRAPH_FILE))


def _graph_tensors(graph: onnx.GraphProto):
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _graph_tensors(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    yield from _graph_tensors(subgraph)


def _tensor_bytes(tensor: onnx.TensorProto, weights_from: Path | None, sources: dict, make: bool = False) -> bytes | None:
    """The tensor's bytes where it belongs in the data file (1 KiB or more, or already in one; a
    deferred weight with `make`); else None."""
    from onnx import numpy_helper

    if is_deferred(tensor):
        return np.ascontiguousarray(made(tensor)).tobytes() if make else None
    if uses_external_data(tensor):
        if weights_from is None:
            raise ExportError(f"tensor {tensor.name} is in a data file, but no folder was given to read it from")
        info = _external(tensor)
        path = Path(weights_from) / info["location"]
        if path not in sources:
            sources[path] = open(path, "rb")
        sources[path].seek(int(info.get("offset", 0)))
        return sources[path].read(int(info["length"])) if "length" in info else sources[path].read()
    if tensor.data_type == onnx.TensorProto.STRING:
        return None
    raw = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
    return raw if len(raw) >= 1024 else None


def _external(tensor: onnx.TensorProto) -> dict[str, str]:
    """Where a tensor in a data file is: location, offset, length."""
    return {entry.key: entry.value for entry in tensor.external_data}


def lm_head(graph: onnx.GraphProto):
    """The MatMul of the hidden states by the lm_head's weight."""
    producers = {output: node for node in graph.node for output in node.output}
    node = producers["logits"]
    while node.op_type in _POSITIONWISE:  # walk back over per-position ops to the MatMul
        node = next(producers[i] for i in node.input if i in producers)
    if node.op_type != "MatMul":
        raise ExportError(f"the logits come from a {node.op_type} node, not the lm_head MatMul edgeinfer expects")
    return node


def last_position_logits(graph: onnx.GraphProto) -> None:
    """Make the graph compute logits for its last `logits_to_keep` positions only (a new int64
    scalar input): the hidden states going into the lm_head MatMul are sliced to those first."""
    node = lm_head(graph)
    hidden = node.input[0]
    names = {
        "count": "edgeinfer_last_count",
        "starts": "edgeinfer_last_start",
        "ends": "edgeinfer_last_end",
        "axes": "edgeinfer_last_axis",
        "axis0": "edgeinfer_last_axis0",
        "out": "edgeinfer_last_hidden",
    }
    graph.input.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, onnx.TensorProto.INT64, []))
    graph.initializer.extend(
        [
            helper.make_tensor(names["ends"], onnx.TensorProto.INT64, [1], [2**62]),
            helper.make_tensor(names["axes"], onnx.TensorProto.INT64, [1], [1]),
            helper.make_tensor(names["axis0"], onnx.TensorProto.INT64, [1], [0]),
        ]
    )
    node.input[0] = names["out"]
    nodes = [
        helper.make_node("Unsqueeze", [LOGITS_TO_KEEP, names["axis0"]], [names["count"]]),
        helper.make_node("Neg", [names["count"]], [names["starts"]]),
        helper.make_node("Slice", [hidden, names["starts"], names["ends"], names["axes"]], [names["out"]], name=LAST_POSITION_NODE),
    ]
    position = list(graph.node).index(node)
    for offset, new in enumerate(nodes):
        graph.node.insert(position + offset, new)
    for output in graph.output:  # the logits' sequence axis is now logits_to_keep
        if output.name == "logits":
            output.type.tensor_type.shape.dim[1].Clear()
            output.type.tensor_type.shape.dim[1].dim_param = LOGITS_TO_KEEP


def tied_embedding(graph: onnx.GraphProto, folder: Path | None = None):
    """The embedding's Gather node where its table is the lm_head's weight transposed (tied
    weights), with the lm_head weight's name; else None. Tensors still in a data file are read
    from `folder`'s, mapped rather than copied."""
    initializers = {t.name: t for t in graph.initializer}
    weight = initializers.get(lm_head(graph).input[1])
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[1] == "input_ids" and n.input[0] in initializers]
    if weight is None or len(gathers) != 1 or len(weight.dims) != 2:
        return None
    (gather,) = gathers
    table = initializers[gather.input[0]]
    if list(table.dims) != list(weight.dims)[::-1] or any(a.name == "axis" and a.i != 0 for a in gather.attribute):
        return None
    if not _transposed_equal(table, weight, folder):
        return None
    return gather, weight.name


def _transposed_equal(table: onnx.TensorProto, weight: onnx.TensorProto, folder: Path | None, rows: int = 16384) -> bool:
    """Whether `table` is `weight` transposed, compared `rows` rows of the table at a time, each
    block through mappings of its own: mapping both whole would keep every page read resident until
    the end."""
    if is_deferred(table) and is_deferred(weight):  # tied: made from one parameter
        return stream.source_of(table) is not None and stream.source_of(table) == stream.source_of(weight)
    if is_deferred(table) or is_deferred(weight):  # made once each, not once a block
        return np.array_equal(tensor_array(table, folder), tensor_array(weight, folder).T)
    for start in range(0, table.dims[0], rows):
        if not np.array_equal(
            tensor_array(table, folder)[start : start + rows], tensor_array(weight, folder)[:, start : start + rows].T
        ):
            return False
    return True


def tensor_array(tensor: onnx.TensorProto, folder: Path | None = None, mapped: bool = True) -> np.ndarray:
    """The tensor's values: mapped from `folder`'s data file where it is there (read into memory of
    its own where not `mapped`: a copy to work in, whose pages are not the file's), else from the
    message."""
    from onnx import numpy_helper

    if is_deferred(tensor):
        return made(tensor)
    if not uses_external_data(tensor):
        return numpy_helper.to_array(tensor)
    if folder is None:
        raise ExportError(f"tensor {tensor.name} is in a data file, but no folder was given to read it from")
    info = _external(tensor)
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    path, offset, shape = Path(folder) / info["location"], int(info.get("offset", 0)), tuple(tensor.dims)
    if not mapped:
        return np.fromfile(path, dtype=dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


def write_weights(path: Path, weights: dict, defer: bool = False) -> None:
    """Make the graph inputs named in `weights` (torch tensors, or functions that make them)
    initializers again, their bytes written to the graph's data file one tensor at a time
    (`defer`: a function's tensor is deferred instead, `stream.defer`). A tensor equal to one
    written before (type, shape and bytes) is read through that one's name, as torch.onnx merges
    equal initializers, which it cannot see in a trace of hollow weights."""
    if not weights:
        return
    model = onnx.load(str(path), load_external_data=False)
    inputs = [i for i in model.graph.input if i.name not in weights]
    if len(inputs) + len(weights) != len(model.graph.input):
        raise ExportError(
            "torch.onnx's graph does not take every weight held apart as an input: this is a bug in edgeinfer, "
            "please report it with the output of --debug"
        )
    data, written, same = path.with_name(f"{path.name}.data"), {}, {}
    with open(data, "ab") as out:
        for name, value in weights.items():
            if defer and callable(value):
                model.graph.initializer.append(stream.defer(name, value, _input_shape(model.graph, name), onnx.TensorProto.FLOAT))
                continue
            proto, digest = _written_tensor(out, data.name, name, value() if callable(value) else value, written)
            if proto is None:
                same[name] = written[digest]
            else:
                written[digest] = name
                model.graph.initializer.append(proto)
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            node.input[index] = same.get(name, name)
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    onnx.save(model, str(path))


def _written_tensor(out, location: str, name: str, tensor, written: dict):
    """The initializer `name` of `tensor`'s bytes, appended to the data file `out` (named
    `location`), and its digest; None for the initializer where `written` (digests of the tensors
    written) has its bytes already."""
    import hashlib

    import torch

    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    digest = (onnx_float(tensor), tuple(tensor.shape), hashlib.sha1(raw.data).hexdigest())
    if digest in written:
        return None, digest
    proto = onnx.TensorProto(name=name, dims=list(tensor.shape), data_type=onnx_float(tensor))
    stream.refer(proto, location, out.tell(), raw.nbytes)
    out.write(raw.data)
    return proto, digest


def _input_shape(graph: onnx.GraphProto, name: str) -> list[int]:
    (value,) = [i for i in graph.input if i.name == name]
    return [d.dim_value for d in value.type.tensor_type.shape.dim]


def kv_layout(folder: Path, spec: GraphSpec) -> KVSpec:
    """The KV cache's layout, read off the graph's past inputs: [batch, kv heads, past, head size]
    each, the sequence axis the one named past_sequence_length."""
    graph = onnx.load(str(folder / spec.file), load_external_data=False).graph
    inputs = [i for i in graph.input if i.name.startswith(PAST_PREFIX)]
    past = [i for i in inputs if not is_state(i.name)]
    dims = [p.type.tensor_type.shape.dim for p in past]
    # a model of state layers alone (Mamba's) has no keys and values: no layer, axis 2 by convention
    sequence_axis = next((k for k, d in enumerate(dims[0]) if "past_sequence_length" in d.dim_param), 2) if dims else 2
    static = [[d.dim_value for k, d in enumerate(dim) if d.dim_value and k != sequence_axis] for dim in dims]
    layers = [
        {"kv_heads": key[0], "head_size": key[-1], "value_head_size": value[-1]} for key, value in zip(static[0::2], static[1::2])
    ]
    first = layers[0] if layers else {"kv_heads": 0, "head_size": 0, "value_head_size": 0}
    return KVSpec(
        num_layers=len(layers),
        num_kv_heads=first["kv_heads"],
        head_size=first["head_size"],
        value_head_size=first["value_head_size"],
        dtype=_ONNX_TYPES[inputs[0].type.tensor_type.elem_type],
        sequence_axis=sequence_axis,
        past=[i.name for i in past],
        present=[PRESENT_PREFIX + i.name[len(PAST_PREFIX) :] for i in past],
        layers=layers if any(layer != layers[0] for layer in layers) else [],
        # a model of state layers alone writes its states in place: rows of a slot cache, as a fused graph's
        in_place=not layers,
        state=[_state_entry(i) for i in inputs if is_state(i.name)],
    )


def _state_entry(value) -> dict:
    """A linear-attention layer's state input as the manifest lists it."""
    layer, kind = value.name[len(PAST_PREFIX) :].split(".")
    return {
        "layer": int(layer),
        "kind": kind,
        "past": value.name,
        "present": PRESENT_PREFIX + value.name[len(PAST_PREFIX) :],
        "shape": [d.dim_value for d in value.type.tensor_type.shape.dim[1:]],
    }
