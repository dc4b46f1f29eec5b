"""Attention rewritten to ONNX Runtime's `GroupQueryAttention`, with the KV cache written in place.

optimum-onnx's graph computes each layer's attention as a chain of small ops: it concatenates the
past keys and values with the new ones (a copy of the whole cache every step), repeats the KV heads
for grouped-query attention (another copy), builds the causal mask, and multiplies. The rewrite
replaces, in every layer, everything from the concatenation to the attention output with one
`GroupQueryAttention` node whose past and present are the same preallocated buffer
[batch, kv_heads, capacity, head_size]: a step writes its new keys and values into the buffer
and reads the cache where it is, so its cost no longer grows with copies of the context.

The rows of a batch are right-padded in that layout (each row's tokens start at slot 0), so the
graph takes the attention mask as each row's length: `seqlens_k` and `total_sequence_length` are
computed from it inside the graph, and the last-position slice before the lm_head becomes a gather
of each row's last real position. The graph keeps its inputs and outputs; the manifest's
`kv.in_place` tells the runtime which layout it serves.

Where the query and key are rotated by one `RotaryEmbedding` right after their projections, the
rotation moves into GroupQueryAttention (its positions are each row's slots, which is this layout's
positions) and the q, k and v projections become one MatMul; elsewhere the rotated tensors are fed
as they are. Norms and the MLP are left as they were. A rewritten graph is kept only if it passes
the export's checks; any layer that does not match the pattern stops the rewrite.
"""
from __future__ import annotations

import collections

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .graphs import LAST_POSITION_NODE, PAST_PREFIX, PRESENT_PREFIX

# Ops a key or value passes through between the cache and the attention MatMuls: head repeats,
# the key's transpose, the scale.
_CACHE_TO_MATMUL = {"Unsqueeze", "Expand", "Reshape", "Transpose", "Mul", "Div", "Cast", "Identity"}
_SHAPE_ARITHMETIC = {"Shape", "Gather", "Slice", "Cast", "Sqrt", "Div", "Mul", "Reciprocal", "Pow", "Unsqueeze", "Squeeze",
                     "Constant", "Identity"}


class PatternError(ValueError):
    """The graph's attention is not the pattern the rewrite knows."""


def layer_windows(config, num_layers: int) -> list[int]:
    """Each layer's sliding window (the number of positions a query attends to, its own included,
    as in transformers; -1: the whole context), from the model's config."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return [-1] * num_layers
    types = getattr(config, "layer_types", None)
    if types:
        return [window if kind == "sliding_attention" else -1 for kind in types]
    return [window] * num_layers


def rewrite_attention(model: onnx.ModelProto, num_heads: int, windows: list[int]) -> int:
    """Rewrite every layer's attention in place; returns the number of layers rewritten. Raises
    PatternError, leaving `model` half-changed, where a layer does not match."""
    graph = model.graph
    view = _View(graph)
    pasts = [i.name for i in graph.input if i.name.startswith(PAST_PREFIX)]
    if not pasts or len(pasts) % 2:
        raise PatternError("the graph has no key/value pairs of past inputs")
    lengths = _mask_lengths(graph)
    layers = [pasts[k:k + 2] for k in range(0, len(pasts), 2)]
    if len(windows) != len(layers):
        raise PatternError(f"{len(windows)} sliding windows given for {len(layers)} layers")
    for index, ((past_key, past_value), window) in enumerate(zip(layers, windows)):
        _rewrite_layer(graph, view, index, past_key, past_value, num_heads, window, lengths)
    _gather_last_positions(graph, view)
    _drop_dead_nodes(graph)
    _name_cache_axes(graph)
    _sort_topologically(graph)
    model.opset_import.extend([] if any(o.domain == "com.microsoft" for o in model.opset_import)
                              else [helper.make_opsetid("com.microsoft", 1)])
    return len(layers)


class _View:
    """Who produces and who consumes each tensor, and the constant tensors' values."""

    def __init__(self, graph):
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers = collections.defaultdict(list)
        for node in graph.node:
            for name in node.input:
                self.consumers[name].append(node)
        self.constants = {t.name: t for t in graph.initializer}
        for node in graph.node:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                self.constants[node.output[0]] = node.attribute[0].t

    def scalar(self, name: str) -> float | None:
        tensor = self.constants.get(name)
        if tensor is None:
            return None
        array = numpy_helper.to_array(tensor)
        return float(array.reshape(-1)[0]) if array.size == 1 else None

    def scale_factor(self, node) -> float | None:
        """The constant factor a Mul or Div by a scalar applies; None for a factor computed from
        tensor shapes at run time (the traced `1 / sqrt(head_size)` of scaled dot-product
        attention); else raise."""
        values = [self.scalar(name) for name in node.input]
        if node.op_type == "Mul" and any(v is not None for v in values):
            return next(v for v in values if v is not None)
        if node.op_type == "Div" and values[1] is not None:
            return 1.0 / values[1]
        if self.from_shapes(node.input[1]) or (node.op_type == "Mul" and self.from_shapes(node.input[0])):
            return None
        raise PatternError(f"{node.name} is a {node.op_type} that is not a scaling by a constant")

    def from_shapes(self, tensor: str, depth: int = 8) -> bool:
        """`tensor` is computed from constants and tensor shapes only."""
        if tensor in self.constants:
            return True
        node = self.producer.get(tensor)
        if node is None or depth == 0 or node.op_type not in _SHAPE_ARITHMETIC:
            return False
        return node.op_type == "Shape" or all(self.from_shapes(name, depth - 1) for name in node.input if name)

    def data_input(self, node) -> str:
        """The input of a scaling Mul or Div that is the scaled tensor."""
        return next(name for name in node.input if self.scalar(name) is None and not self.from_shapes(name))


def _rewrite_layer(graph, view: _View, index: int, past_key: str, past_value: str, num_heads: int,
                   window: int, lengths: tuple[str, str]) -> None:
    present_key = PRESENT_PREFIX + past_key[len(PAST_PREFIX):]
    present_value = PRESENT_PREFIX + past_value[len(PAST_PREFIX):]
    key_concat, value_concat = (_cache_concat(view, past, present) for past, present in
                                ((past_key, present_key), (past_value, present_value)))
    scores, key_scale = _matmul_fed_by(view, present_key)
    weighted, _ = _matmul_fed_by(view, present_value)
    query, query_scale = _query_of(view, scores)
    softmax_scale = _scores_to_weights(view, scores, weighted)
    output = _attention_output(view, weighted)
    kv_heads = _kv_heads(graph, past_key)
    head_size = _head_size(graph, past_key)
    if _head_size(graph, past_value) != head_size:
        raise PatternError("keys and values have different head sizes, which GroupQueryAttention does not take")
    prefix = f"edgeinfer_gqa_{index}"
    inputs, rotary = _gqa_inputs(graph, view, prefix, query, key_concat.input[1], value_concat.input[1], head_size)
    graph.node.append(helper.make_node(
        "GroupQueryAttention", [*inputs, past_key, past_value, *lengths, *rotary.get("caches", [])],
        [output.output[0], present_key, present_value], name=prefix, domain="com.microsoft",
        num_heads=num_heads, kv_num_heads=kv_heads, scale=_scale(head_size, query_scale, key_scale, softmax_scale),
        local_window_size=window, do_rotary=int(bool(rotary)), rotary_interleaved=rotary.get("interleaved", 0)))
    for node in (key_concat, value_concat, output):
        graph.node.remove(node)


def _gqa_inputs(graph, view: _View, prefix: str, query: str, key: str, value: str, head_size: int):
    """GroupQueryAttention's query, key and value inputs, [batch, seq, heads * head_size], and its
    rotary settings ({} where the graph's own rotary nodes stay in front of it).

    In the usual pattern (each projection reshaped to heads, transposed, the query and key
    rotated by the same `RotaryEmbedding`), the projections themselves are the inputs, packed into
    one MatMul where all three read the same input, and the rotation moves into
    GroupQueryAttention, whose positions (each row's slot) are the positions of this layout.
    Anything else is transposed back into [batch, seq, hidden] as it is."""
    rotated = [view.producer.get(t) for t in (query, key)]
    if all(n is not None and n.op_type == "RotaryEmbedding" for n in rotated) and _same_rotary(view, *rotated, head_size):
        projections = [_projection(view, t) for t in (rotated[0].input[0], rotated[1].input[0], value)]
        if all(projections):
            rotary = {"caches": list(rotated[0].input[2:4]),
                      "interleaved": next((a.i for a in rotated[0].attribute if a.name == "interleaved"), 0)}
            packed = _pack_projections(graph, view, prefix, projections)
            return ([packed, "", ""] if packed else projections), rotary
    projections = [_projection(view, t) for t in (query, key, value)]
    if all(projections):
        packed = _pack_projections(graph, view, prefix, projections)
        return ([packed, "", ""] if packed else projections), {}
    names = []
    for role, tensor, projection in zip(("query", "key", "value"), (query, key, value), projections):
        name = projection or f"{prefix}_{role}"
        if not projection:
            graph.node.extend([helper.make_node("Transpose", [tensor], [f"{name}_bsnh"], perm=[0, 2, 1, 3]),
                               helper.make_node("Reshape", [f"{name}_bsnh", "edgeinfer_gqa_bsh_shape"], [name])])
        names.append(name)
    return names, {}


def _same_rotary(view: _View, a, b, head_size: int) -> bool:
    """Query and key rotated alike, over the whole head, by cos/sin caches GroupQueryAttention can take."""
    plain = all(attr.name == "interleaved" for node in (a, b) for attr in node.attribute)
    caches = view.constants.get(a.input[2])
    return (plain and list(a.input[1:4]) == list(b.input[1:4]) and caches is not None
            and caches.dims[-1] * 2 == head_size
            and [x.i for x in a.attribute] == [x.i for x in b.attribute])


def _projection(view: _View, bnsh: str) -> str | None:
    """The [batch, seq, heads * head] tensor that `bnsh` is only a reshape and transpose of."""
    transpose = view.producer.get(bnsh)
    if transpose is None or transpose.op_type != "Transpose" or list(transpose.attribute[0].ints) != [0, 2, 1, 3]:
        return None
    reshape = view.producer.get(transpose.input[0])
    if reshape is None or reshape.op_type != "Reshape":
        return None
    return reshape.input[0] if _is_linear(view, reshape.input[0]) else None


def _is_linear(view: _View, tensor: str) -> bool:
    """`tensor` is hidden states times a constant 2-D weight (plus a constant bias): it has the
    hidden states' [batch, seq, features] shape."""
    node = view.producer.get(tensor)
    if node is not None and node.op_type == "Add":
        node = next((view.producer.get(name) for name in node.input if name not in view.constants), None)
    weight = view.constants.get(node.input[1]) if node is not None and node.op_type == "MatMul" else None
    return weight is not None and len(weight.dims) == 2


def _pack_projections(graph, view: _View, prefix: str, projections: list[str]) -> str | None:
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
    packed = np.concatenate([numpy_helper.to_array(w) for w in weights], axis=1)
    graph.initializer.append(numpy_helper.from_array(packed, f"{prefix}_qkv_weight"))
    graph.node.append(helper.make_node("MatMul", [matmuls[0].input[0], f"{prefix}_qkv_weight"], [f"{prefix}_qkv"],
                                       name=f"{prefix}_qkv_proj"))
    return f"{prefix}_qkv"


def _scale(head_size: int, *factors: float | None) -> float:
    """The product of the constant factors; factors computed at run time (None) are taken as the
    pair scaled dot-product attention traces, 1 / sqrt(head_size) in all (the check confirms it)."""
    constant = float(np.prod([f for f in factors if f is not None]))
    return constant * (head_size ** -0.5 if None in factors else 1.0)


def _cache_concat(view: _View, past: str, present: str):
    node = view.producer.get(present)
    if node is None or node.op_type != "Concat" or node.input[0] != past or len(node.input) != 2:
        raise PatternError(f"{present} is not the concatenation of {past} with the new tokens")
    return node


def _matmul_fed_by(view: _View, cache: str):
    """The MatMul that the cache `cache` feeds as its second operand, through head repeats and
    transposes, and the constant scale applied on the way."""
    found, frontier = [], [(cache, 1.0)]
    while frontier:
        tensor, scale = frontier.pop()
        for node in view.consumers[tensor]:
            if node.op_type == "MatMul" and node.input[1] == tensor:
                found.append((node, scale))
            elif node.op_type in _CACHE_TO_MATMUL and node.input[0] == tensor:
                factor = view.scale_factor(node) if node.op_type in ("Mul", "Div") else 1.0
                frontier.append((node.output[0], _times(scale, factor)))
    if len(found) != 1:
        raise PatternError(f"{cache} feeds {len(found)} attention MatMuls, not one")
    return found[0]


def _times(scale: float | None, factor: float | None) -> float | None:
    """A product of scale factors, None once any is computed at run time."""
    return None if scale is None or factor is None else scale * factor


def _query_of(view: _View, scores) -> tuple[str, float]:
    """The query going into the scores MatMul, before any scaling, and that scaling."""
    tensor, scale = scores.input[0], 1.0
    while (node := view.producer.get(tensor)) is not None and node.op_type in ("Mul", "Div"):
        scale = _times(scale, view.scale_factor(node))
        tensor = view.data_input(node)
    return tensor, scale


def _scores_to_weights(view: _View, scores, weighted) -> float:
    """Check that only the mask, a scaling and a softmax lie between the two MatMuls; returns the scaling."""
    tensor, scale, softmax = weighted.input[0], 1.0, False
    while tensor != scores.output[0]:
        node = view.producer.get(tensor)
        if node is None:
            raise PatternError("the attention weights do not come from the scores MatMul")
        if node.op_type == "Softmax":
            softmax, tensor = True, node.input[0]
        elif node.op_type == "Where":  # the guard against all-masked rows: Where(IsNaN(p), 0, p)
            tensor = node.input[2]
        elif node.op_type == "Add":  # scores + mask
            tensor = next((name for name in node.input if _leads_to(view, name, scores.output[0])), None)
            if tensor is None:
                raise PatternError(f"{node.name} adds two tensors neither of which holds the scores")
        elif node.op_type in ("Mul", "Div"):
            scale = _times(scale, view.scale_factor(node))
            tensor = view.data_input(node)
        else:
            raise PatternError(f"the attention scores pass through a {node.op_type} ({node.name}) the rewrite does not know")
    if not softmax:
        raise PatternError("no Softmax between the attention MatMuls")
    return scale


def _leads_to(view: _View, tensor: str, target: str, depth: int = 4) -> bool:
    if tensor == target:
        return True
    node = view.producer.get(tensor)
    return depth > 0 and node is not None and any(_leads_to(view, name, target, depth - 1) for name in node.input)


def _attention_output(view: _View, weighted):
    """The Reshape that turns the attention output [batch, heads, seq, head] into [batch, seq, hidden]."""
    (transpose,) = view.consumers[weighted.output[0]] or [None]
    if transpose is None or transpose.op_type != "Transpose" or list(transpose.attribute[0].ints) != [0, 2, 1, 3]:
        raise PatternError(f"the output of {weighted.name} is not transposed to [batch, seq, heads, head]")
    consumers = view.consumers[transpose.output[0]]
    if len(consumers) != 1 or consumers[0].op_type != "Reshape":
        raise PatternError(f"the output of {transpose.name} is not reshaped to [batch, seq, hidden]")
    return consumers[0]


def _head_size(graph, past_key: str) -> int:
    shape = next(i for i in graph.input if i.name == past_key).type.tensor_type.shape.dim
    if not shape[3].dim_value:
        raise PatternError(f"{past_key} has no fixed head size")
    return shape[3].dim_value


def _kv_heads(graph, past_key: str) -> int:
    shape = next(i for i in graph.input if i.name == past_key).type.tensor_type.shape.dim
    if not shape[1].dim_value:
        raise PatternError(f"{past_key} has no fixed number of KV heads")
    return shape[1].dim_value


def _mask_lengths(graph) -> tuple[str, str]:
    """Nodes computing GroupQueryAttention's `seqlens_k` (each row's length - 1, int32) and
    `total_sequence_length` (the mask's width, int32) from the attention mask."""
    if "attention_mask" not in {i.name for i in graph.input}:
        raise PatternError("the graph takes no attention mask")
    graph.initializer.extend([
        numpy_helper.from_array(np.array([1], np.int64), "edgeinfer_gqa_axis1"),
        numpy_helper.from_array(np.array(1, np.int64), "edgeinfer_gqa_one"),
        numpy_helper.from_array(np.array(0, np.int64), "edgeinfer_gqa_zero"),
        numpy_helper.from_array(np.array([0, 0, -1], np.int64), "edgeinfer_gqa_bsh_shape"),
    ])
    graph.node.extend([
        helper.make_node("ReduceSum", ["attention_mask", "edgeinfer_gqa_axis1"], ["edgeinfer_gqa_lengths"], keepdims=0),
        helper.make_node("Sub", ["edgeinfer_gqa_lengths", "edgeinfer_gqa_one"], ["edgeinfer_gqa_last"]),
        helper.make_node("Cast", ["edgeinfer_gqa_last"], ["edgeinfer_gqa_seqlens_k"], to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["edgeinfer_gqa_mask_shape"]),
        helper.make_node("Gather", ["edgeinfer_gqa_mask_shape", "edgeinfer_gqa_one"], ["edgeinfer_gqa_width"]),
        helper.make_node("Cast", ["edgeinfer_gqa_width"], ["edgeinfer_gqa_total"], to=TensorProto.INT32),
    ])
    return "edgeinfer_gqa_seqlens_k", "edgeinfer_gqa_total"


def _gather_last_positions(graph, view: _View) -> None:
    """Replace the slice of the last position by a gather of each row's last real position:
    min(row length - 1, chunk length - 1), which is the row's last token in a right-padded first
    prompt, and the chunk's last one in decode and in later chunks of one prompt."""
    node = next((n for n in graph.node if n.name == LAST_POSITION_NODE), None)
    if node is None:
        raise PatternError(f"the graph has no {LAST_POSITION_NODE} slice")
    hidden, out = node.input[0], node.output[0]
    graph.node.remove(node)
    g = "edgeinfer_last"
    graph.node.extend([
        helper.make_node("Shape", ["input_ids"], [f"{g}_ids_shape"]),
        helper.make_node("Gather", [f"{g}_ids_shape", "edgeinfer_gqa_one"], [f"{g}_chunk"]),
        helper.make_node("Gather", [f"{g}_ids_shape", "edgeinfer_gqa_zero"], [f"{g}_batch"]),
        helper.make_node("Sub", [f"{g}_chunk", "edgeinfer_gqa_one"], [f"{g}_chunk_last"]),
        helper.make_node("Min", ["edgeinfer_gqa_last", f"{g}_chunk_last"], [f"{g}_index"]),
        helper.make_node("Range", ["edgeinfer_gqa_zero", f"{g}_batch", "edgeinfer_gqa_one"], [f"{g}_rows"]),
        helper.make_node("Mul", [f"{g}_rows", f"{g}_chunk"], [f"{g}_row_starts"]),
        helper.make_node("Add", [f"{g}_row_starts", f"{g}_index"], [f"{g}_flat_index"]),
        helper.make_node("Flatten", [hidden], [f"{g}_flat_hidden"], axis=2),
        helper.make_node("Gather", [f"{g}_flat_hidden", f"{g}_flat_index"], [f"{g}_rows_hidden"], axis=0),
        helper.make_node("Unsqueeze", [f"{g}_rows_hidden", "edgeinfer_gqa_axis1"], [out]),
    ])


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
    used = {name for node in graph.node for name in node.input}
    for tensor in [t for t in graph.initializer if t.name not in used]:
        graph.initializer.remove(tensor)
    for value in [i for i in graph.input if i.name not in used]:  # position_ids, once rotation is in the attention
        graph.input.remove(value)


def _name_cache_axes(graph) -> None:
    """Past and present are now one buffer of `cache_capacity` slots, and the mask covers the
    longest row: name the axes so."""
    for value in list(graph.input) + list(graph.output):
        dims = value.type.tensor_type.shape.dim
        if value.name.startswith((PAST_PREFIX, PRESENT_PREFIX)):
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
