"""Attention rewritten to ONNX Runtime's `GroupQueryAttention`, with the KV cache written in place.

The traced graph computes each layer's attention as a chain of small ops: it concatenates the
past keys and values with the new ones (a copy of the whole cache every step), repeats the KV heads
for grouped-query attention (another copy), builds the causal mask, and multiplies. The rewrite
replaces, in every layer, everything from the concatenation to the attention output with one
`GroupQueryAttention` node whose past and present are the same preallocated buffer
[batch, kv_heads, capacity, head_size]: a step writes its new keys and values into the buffer
and reads the cache where it is, so its cost no longer grows with copies of the context.

The rows of a batch are right-padded in that layout (each row's tokens start at slot 0), so the
graph takes the attention mask as each row's length: `seqlens_k` and `total_sequence_length` are
computed from it inside the graph, and the last-positions slice before the lm_head becomes a gather
of each row's last `logits_to_keep` real positions. The graph keeps its inputs and outputs; the manifest's
`kv.in_place` tells the runtime which layout it serves.

Where the query and key are rotated by one `RotaryEmbedding` right after their projections, the
rotation moves into GroupQueryAttention (its positions are each row's slots, which is this layout's
positions) and the q, k and v projections become one MatMul. A rotation written out in ops moves
in too, its cos and sin caches evaluated from the graph's own computation of them for every
position of the context; a norm over each head before it (Gemma 3's q_norm and k_norm) is applied
to the projection reshaped to [batch, seq, heads, head], and the projections stay apart. Elsewhere
the rotated tensors are fed as they are. The layers' norms and the MLP are left as they were.
attention_pattern.py finds what each layer computes; this module builds the new nodes. Every layer
is matched before the graph is changed, and a rewritten graph is kept only if it passes the
export's checks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .attention_pattern import GraphView, LayerAttention, PatternError, find_layer, key_value_pairs
from .graphs import LAST_POSITION_NODE, LOGITS_TO_KEEP, PAST_PREFIX, PRESENT_PREFIX, drop_unused_initializers
from .trace import is_state

__all__ = ["PatternError", "cached_windows", "layer_windows", "rewrite_attention"]


class _Shared:
    """Tensors the rewrite adds once per graph and several of its nodes read."""

    AXIS1 = "edgeinfer_gqa_axis1"  # [1], for ReduceSum and Unsqueeze
    ONE = "edgeinfer_gqa_one"
    ZERO = "edgeinfer_gqa_zero"
    TO_HIDDEN = "edgeinfer_gqa_bsh_shape"  # [0, 0, -1]: [batch, seq, heads, head] -> [batch, seq, hidden]
    LAST = "edgeinfer_gqa_last"  # each row's length - 1 (int64)
    SEQLENS_K = "edgeinfer_gqa_seqlens_k"  # the same, int32, as GroupQueryAttention takes it
    TOTAL = "edgeinfer_gqa_total"  # the mask's width, int32


_ATTENTION_KINDS = ("full_attention", "sliding_attention", "attention")


def layer_windows(config, num_layers: int) -> list[int]:
    """Each cached attention layer's sliding window (the number of positions a query attends to,
    its own included, as in transformers; -1: the whole context), from the model's config. Layers
    of other kinds (linear attention) cache no keys; layers that read an earlier layer's cache
    (Gemma 4's KV sharing) are the last ones, past the `num_layers` that cache."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [-1] * num_layers
    types = [kind for kind in getattr(config, "layer_types", None) or [] if kind in _ATTENTION_KINDS]
    if types:
        return [window if kind == "sliding_attention" else -1 for kind in types[:num_layers]]
    return [window] * num_layers


def cached_windows(model: onnx.ModelProto, past: list[str]) -> list[int]:
    """Each cached layer's window where its GroupQueryAttention keeps only the window (-1 where it
    keeps every token), in the order of the past inputs `past` (each layer's keys, then values);
    empty where no layer keeps a window."""
    windows = [-1] * (len(past) // 2)
    for node in model.graph.node:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "GroupQueryAttention" and attributes.get("sliding_window_cache"):
            windows[past.index(node.input[3]) // 2] = attributes["local_window_size"]
    return windows if any(w > 0 for w in windows) else []


def rewrite_attention(
    model: onnx.ModelProto, num_heads: int, windows: list[int], positions: int, weights_from=None, rotary_outside: bool = False
) -> int:
    """Rewrite every layer's attention in place, for contexts of up to `positions` tokens; returns
    the number of layers rewritten. Raises PatternError, before changing anything, where a layer
    does not match. Weights the model keeps in a data file are read from the folder `weights_from`.
    `rotary_outside`: the rotations stay in the graph (positions GroupQueryAttention does not
    compute: three numbers a token), its query and key fed as they come out rotated."""
    graph = model.graph
    view = GraphView(graph, weights_from)
    if "attention_mask" not in view.inputs:
        raise PatternError("the graph takes no attention mask")
    if not any(n.name == LAST_POSITION_NODE for n in graph.node):
        raise PatternError(f"the graph has no {LAST_POSITION_NODE} slice")
    pairs = key_value_pairs(graph)
    if len(windows) != len(pairs):
        raise PatternError(f"{len(windows)} sliding windows given for {len(pairs)} layers")
    layers = [find_layer(view, past_key, past_value, rotary_outside) for past_key, past_value in pairs]
    layers = _with_evaluated_caches(model, view, layers, positions)
    _add_lengths(graph)
    for index, (layer, window) in enumerate(zip(layers, windows)):
        _replace_layer(graph, view, f"edgeinfer_gqa_{index}", layer, num_heads, window, windowed=0 < window < positions)
    _gather_last_positions(graph)
    _drop_dead_nodes(graph)
    _name_cache_axes(graph)
    _sort_topologically(graph)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return len(layers)


def _replace_layer(graph, view: GraphView, name: str, layer: LayerAttention, num_heads: int, window: int, windowed: bool) -> None:
    """One layer's attention as GroupQueryAttention. A sliding layer (`windowed`) keeps only its
    window: its past is a buffer of a few more slots than the window, in which the op keeps the
    latest positions from slot 0 and evicts the oldest (`sliding_window_cache`)."""
    query_key_value = _attention_inputs(graph, view, name, layer)
    caches = layer.rotary.caches if layer.rotary else []
    output = f"{name}_hidden" if layer.output_per_head else layer.output
    if layer.output_per_head:  # [batch, seq, hidden] back to the [batch, seq, heads, head] the gate multiplies
        shape = _heads_shape(graph, layer.head_size)
        graph.node.append(helper.make_node("Reshape", [output, shape], [layer.output], name=f"{name}_per_head"))
    graph.node.append(
        helper.make_node(
            "GroupQueryAttention",
            [*query_key_value, layer.past_key, layer.past_value, _Shared.SEQLENS_K, _Shared.TOTAL, *caches],
            [output, layer.present_key, layer.present_value],
            name=name,
            domain="com.microsoft",
            num_heads=num_heads,
            kv_num_heads=layer.num_kv_heads,
            scale=layer.scale,
            local_window_size=window,
            sliding_window_cache=int(windowed),
            softcap=layer.softcap,
            do_rotary=int(layer.rotary is not None),
            rotary_interleaved=layer.rotary.interleaved if layer.rotary else 0,
        )
    )
    for node in layer.replaced:
        graph.node.remove(node)


def _with_evaluated_caches(model, view: GraphView, layers: list[LayerAttention], positions: int) -> list[LayerAttention]:
    """`layers` with each rotation written out in ops given constant cos and sin caches
    [positions, head / 2]: the graph's own cos and sin computation run once for positions 0 to
    `positions` - 1, one pair of caches per pair of tensors (Gemma 3 has one for its local layers
    and one for its global layers)."""
    caches, tables = {}, []
    for layer in layers:
        if layer.rotary and layer.rotary.computed and tuple(layer.rotary.caches) not in caches:
            name = f"edgeinfer_rotary_{len(caches)}"
            for tensor, computed, suffix in zip(
                _positions_run(model, view, layer.rotary.caches, positions), layer.rotary.caches, ("cos", "sin")
            ):
                half = tensor.shape[-1] // 2
                if not np.array_equal(tensor[..., :half], tensor[..., half:]):
                    raise PatternError(f"the rotation's {suffix} tensor {computed} is not two equal halves")
                tables.append(numpy_helper.from_array(np.ascontiguousarray(tensor[0, :, :half]), f"{name}_{suffix}"))
            caches[tuple(layer.rotary.caches)] = [f"{name}_cos", f"{name}_sin"]
    model.graph.initializer.extend(tables)  # once every rotation has matched
    return [
        dataclasses.replace(layer, rotary=dataclasses.replace(layer.rotary, caches=caches[tuple(layer.rotary.caches)], computed=False))
        if layer.rotary and layer.rotary.computed
        else layer
        for layer in layers
    ]


def _positions_run(model, view: GraphView, outputs: list[str], positions: int) -> list[np.ndarray]:
    """`outputs`, computed from `position_ids` alone, for positions 0 to `positions` - 1 of one row:
    the nodes they depend on, run by ONNX Runtime with their constants."""
    import onnxruntime as ort

    nodes, needed, pending = [], set(), list(outputs)
    while pending:
        tensor = pending.pop()
        if tensor in needed or not tensor:
            continue
        needed.add(tensor)
        node = view.producer.get(tensor)
        if node is not None:
            nodes.append(node)
            pending.extend(node.input)
        elif tensor != "position_ids" and tensor not in view.constants:
            raise PatternError(f"the rotation's cos and sin depend on {tensor}, not on the positions alone")
    if "position_ids" not in needed:
        raise PatternError("the rotation's cos and sin do not depend on position_ids")
    chosen = {id(node) for node in nodes}
    order = [node for node in model.graph.node if id(node) in chosen]  # the graph's own (topological) order
    constants = [
        numpy_helper.from_array(view.array(view.constants[t]), t) for t in needed if t in view.constants and t not in view.producer
    ]
    graph = helper.make_graph(
        order,
        "edgeinfer_rotary",
        [view.inputs["position_ids"]],
        [helper.make_tensor_value_info(t, TensorProto.FLOAT, None) for t in outputs],
        constants,
    )
    small = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    session = ort.InferenceSession(small.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(outputs, {"position_ids": np.arange(positions, dtype=np.int64)[None]})


def _attention_inputs(graph, view: GraphView, name: str, layer: LayerAttention) -> list[str]:
    """GroupQueryAttention's query, key and value inputs, each [batch, seq, heads * head_size]:
    the projections with their norms over each head where there are such norms, one packed QKV
    MatMul where the three projections allow it, the projections themselves where they exist, and
    elsewhere the [batch, heads, seq, head] tensor transposed back."""
    if layer.head_norms:
        (query, key, value), (query_norm, key_norm) = layer.projections, layer.head_norms
        return [
            _normed(graph, f"{name}_query", query, query_norm, layer.head_size),
            _normed(graph, f"{name}_key", key, key_norm, layer.head_size),
            value,
        ]
    if all(layer.projections):
        packed = _pack_projections(graph, view, name, layer.projections)
        return [packed, "", ""] if packed else list(layer.projections)
    names = []
    for role, tensor, projection in zip(("query", "key", "value"), (layer.query, layer.key, layer.value), layer.projections):
        if projection is None:
            projection = f"{name}_{role}"
            graph.node.extend(
                [
                    helper.make_node("Transpose", [tensor], [f"{projection}_bsnh"], perm=[0, 2, 1, 3]),
                    helper.make_node("Reshape", [f"{projection}_bsnh", _Shared.TO_HIDDEN], [projection]),
                ]
            )
        names.append(projection)
    return names


def _normed(graph, name: str, projection: str, norm, head_size: int) -> str:
    """`norm` (over each head's last axis) applied to `projection` [batch, seq, heads * head] as
    [batch, seq, heads, head], and the result as [batch, seq, heads * head] again."""
    shape = _heads_shape(graph, head_size)
    copy = helper.make_node(
        norm.op_type, [f"{name}_heads", *norm.input[1:]], [f"{name}_normed"], name=f"{name}_norm", domain=norm.domain
    )
    copy.attribute.extend(norm.attribute)
    graph.node.extend(
        [
            helper.make_node("Reshape", [projection, shape], [f"{name}_heads"]),
            copy,
            helper.make_node("Reshape", [f"{name}_normed", _Shared.TO_HIDDEN], [f"{name}_projection"]),
        ]
    )
    return f"{name}_projection"


def _heads_shape(graph, head_size: int) -> str:
    """The [0, 0, -1, head_size] shape constant ([batch, seq, hidden] -> [batch, seq, heads, head]), added once."""
    shape = f"edgeinfer_gqa_heads_{head_size}"
    if not any(t.name == shape for t in graph.initializer):
        graph.initializer.append(numpy_helper.from_array(np.array([0, 0, -1, head_size], np.int64), shape))
    return shape


def _pack_projections(graph, view: GraphView, name: str, projections: list[str]) -> str | None:
    """One MatMul for the query, key and value projections where they are three MatMuls of the same
    input by constant weights; returns its output (GroupQueryAttention's packed QKV input)."""
    matmuls = [view.producer.get(t) for t in projections]
    if not all(m is not None and m.op_type == "MatMul" for m in matmuls):
        return None
    if len({m.input[0] for m in matmuls}) != 1:
        return None
    weights = [view.constants.get(m.input[1]) for m in matmuls]
    if any(w is None or len(w.dims) != 2 for w in weights):
        return None
    graph.initializer.append(view.joined(weights, f"{name}_qkv_weight"))
    graph.node.append(
        helper.make_node("MatMul", [matmuls[0].input[0], f"{name}_qkv_weight"], [f"{name}_qkv"], name=f"{name}_qkv_proj")
    )
    return f"{name}_qkv"


def _add_lengths(graph) -> None:
    """The shared tensors: GroupQueryAttention's `seqlens_k` (each row's length - 1, int32) and
    `total_sequence_length` (the mask's width, int32), computed from the attention mask."""
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([1], np.int64), _Shared.AXIS1),
            numpy_helper.from_array(np.array(1, np.int64), _Shared.ONE),
            numpy_helper.from_array(np.array(0, np.int64), _Shared.ZERO),
            numpy_helper.from_array(np.array([0, 0, -1], np.int64), _Shared.TO_HIDDEN),
        ]
    )
    graph.node.extend(
        [
            helper.make_node("ReduceSum", ["attention_mask", _Shared.AXIS1], ["edgeinfer_gqa_lengths"], keepdims=0),
            helper.make_node("Sub", ["edgeinfer_gqa_lengths", _Shared.ONE], [_Shared.LAST]),
            helper.make_node("Cast", [_Shared.LAST], [_Shared.SEQLENS_K], to=TensorProto.INT32),
            helper.make_node("Shape", ["attention_mask"], ["edgeinfer_gqa_mask_shape"]),
            helper.make_node("Gather", ["edgeinfer_gqa_mask_shape", _Shared.ONE], ["edgeinfer_gqa_width"]),
            helper.make_node("Cast", ["edgeinfer_gqa_width"], [_Shared.TOTAL], to=TensorProto.INT32),
        ]
    )


def _gather_last_positions(graph) -> None:
    """Replace the slice of the last positions by a gather of each row's last `logits_to_keep`
    real positions, the last of them min(row length - 1, chunk length - 1): the row's last token in
    a right-padded first prompt, and the chunk's last one in decode and in later chunks of one
    prompt (those before it clamped at the chunk's first)."""
    node = next(n for n in graph.node if n.name == LAST_POSITION_NODE)
    hidden, out = node.input[0], node.output[0]
    graph.node.remove(node)
    g = "edgeinfer_last"
    graph.node.extend(
        [
            helper.make_node("Shape", ["input_ids"], [f"{g}_ids_shape"]),
            helper.make_node("Gather", [f"{g}_ids_shape", _Shared.ONE], [f"{g}_chunk"]),
            helper.make_node("Gather", [f"{g}_ids_shape", _Shared.ZERO], [f"{g}_batch"]),
            helper.make_node("Sub", [f"{g}_chunk", _Shared.ONE], [f"{g}_chunk_last"]),
            helper.make_node("Min", [_Shared.LAST, f"{g}_chunk_last"], [f"{g}_index"]),
            helper.make_node("Sub", [_Shared.ONE, LOGITS_TO_KEEP], [f"{g}_first_offset"]),
            helper.make_node("Range", [f"{g}_first_offset", _Shared.ONE, _Shared.ONE], [f"{g}_offsets"]),  # 1 - n .. 0
            helper.make_node("Unsqueeze", [f"{g}_index", _Shared.AXIS1], [f"{g}_index_column"]),
            helper.make_node("Add", [f"{g}_index_column", f"{g}_offsets"], [f"{g}_unclamped"]),
            helper.make_node("Max", [f"{g}_unclamped", _Shared.ZERO], [f"{g}_positions"]),  # [batch, n]
            helper.make_node("Range", [_Shared.ZERO, f"{g}_batch", _Shared.ONE], [f"{g}_rows"]),
            helper.make_node("Mul", [f"{g}_rows", f"{g}_chunk"], [f"{g}_row_starts"]),
            helper.make_node("Unsqueeze", [f"{g}_row_starts", _Shared.AXIS1], [f"{g}_row_starts_column"]),
            helper.make_node("Add", [f"{g}_row_starts_column", f"{g}_positions"], [f"{g}_flat_index"]),
            helper.make_node("Flatten", [hidden], [f"{g}_flat_hidden"], axis=2),
            helper.make_node("Gather", [f"{g}_flat_hidden", f"{g}_flat_index"], [out], axis=0),  # [batch, n, hidden]
        ]
    )


def _drop_dead_nodes(graph) -> None:
    """Remove the nodes nothing reads any more (the old attention chains and mask building), and
    initializers no node reads."""
    outputs = {o.name for o in graph.output}
    while True:
        used = {name for node in graph.node for name in node.input} | outputs
        dead = [node for node in graph.node if not any(out in used for out in node.output)]
        if not dead:
            break
        for node in dead:
            graph.node.remove(node)
    drop_unused_initializers(graph)
    used = {name for node in graph.node for name in node.input}
    for value in [i for i in graph.input if i.name not in used]:  # position_ids, once rotation is in the attention
        graph.input.remove(value)


def _name_cache_axes(graph) -> None:
    """Past and present keys and values are now one buffer of `cache_capacity` slots, and the mask
    covers the longest row: name the axes so (a state's axes are its fixed sizes)."""
    for value in list(graph.input) + list(graph.output):
        dims = value.type.tensor_type.shape.dim
        if value.name.startswith((PAST_PREFIX, PRESENT_PREFIX)) and not is_state(value.name):
            dims[2].Clear()
            dims[2].dim_param = "cache_capacity"
        elif value.name == "attention_mask":
            dims[1].Clear()
            dims[1].dim_param = "total_sequence_length"


def _sort_topologically(graph) -> None:
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        ready = [n for n in pending if all(name in available for name in n.input)]
        if not ready:
            raise PatternError("the rewritten graph has a cycle or a missing input")
        for node in ready:
            available.update(node.output)
        ordered.extend(ready)
        pending = [n for n in pending if not any(n is r for r in ready)]
    del graph.node[:]
    graph.node.extend(ordered)
