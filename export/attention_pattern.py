"""Finding each layer's attention in the traced graph (export/trace.py), for the rewrite in attention.py.

This module only reads the graph. For one layer it finds the nodes from the concatenation of the
past keys and values with the new ones to the attention output (the head repeats, the mask, the
two MatMuls and the softmax between them) and the facts GroupQueryAttention needs: the query, key
and value going in, the scale, the head counts and sizes, and whether one rotary embedding rotates
the query and key right after their projections. Anything that is not that pattern raises
PatternError, which means "the rewrite does not apply"; attention.py builds the new nodes.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from .graphs import GRAPH_FILE, PAST_PREFIX, PRESENT_PREFIX
from .stream import defer, is_deferred, made, refer

PACKED_FILE = f"{GRAPH_FILE}.packed.data"  # the packed weights of a rewrite, until the graph is saved

# Ops a key or value passes through between the cache and the attention MatMuls: head repeats,
# the key's transpose, the scale.
_CACHE_TO_MATMUL = {"Unsqueeze", "Expand", "Reshape", "Transpose", "Mul", "Div", "Cast", "Identity"}
_SHAPE_ARITHMETIC = {
    "Shape",
    "Gather",
    "Slice",
    "Cast",
    "Sqrt",
    "Div",
    "Mul",
    "Reciprocal",
    "Pow",
    "Unsqueeze",
    "Squeeze",
    "Constant",
    "Identity",
}
_TO_HEADS_FIRST = [0, 2, 1, 3]  # [batch, seq, heads, head] <-> [batch, heads, seq, head]


class PatternError(ValueError):
    """The graph's attention is not the pattern the rewrite knows."""


@dataclass(frozen=True)
class Rotary:
    """A rotary embedding that moves into GroupQueryAttention: its cos and sin caches
    ([positions, head / 2] constants), or, where the rotation is written out in ops (`computed`),
    the [batch, seq, head] cos and sin tensors the graph computes from the positions, which the
    rewrite evaluates into caches."""

    caches: list[str]
    interleaved: int
    computed: bool = False


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention as the graph computes it, and what replaces it.

    `query`, `key` and `value` are the [batch, heads, seq, head] tensors entering the attention
    (`key` and `value` are the new tokens', before the concatenation with the past). Where they
    are only a reshape and transpose of a projection [batch, seq, heads * head], `projections`
    holds that tensor (None where not); with `rotary`, those are the projections before the
    rotation, which then moves into GroupQueryAttention, and `head_norms` the norms over each
    head that the query and key pass through before it (Gemma 3's and Qwen 3's q_norm and k_norm),
    or None. `output` is the attention's result, [batch, seq, hidden]; `replaced` are the nodes the
    new node takes the place of (the rest of the old chain is left to dead-node removal)."""

    past_key: str
    past_value: str
    present_key: str
    present_value: str
    query: str
    key: str
    value: str
    projections: list[str | None]
    rotary: Rotary | None
    output: str
    replaced: list
    num_kv_heads: int
    head_size: int
    scale: float
    head_norms: list | None = None
    softcap: float = 0.0  # cap * tanh(scores / cap) before the softmax (Gemma 2); 0 for none
    output_per_head: bool = False  # `output` is [batch, seq, heads, head] (a gate per head follows), not [batch, seq, hidden]


class GraphView:
    """Who produces and who consumes each tensor, and the constant tensors' values."""

    def __init__(self, graph, weights_from=None):
        self.weights_from = None if weights_from is None else str(weights_from)
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers = collections.defaultdict(list)
        for node in graph.node:
            for name in node.input:
                self.consumers[name].append(node)
        self.constants = {t.name: t for t in graph.initializer}
        for node in graph.node:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                self.constants[node.output[0]] = node.attribute[0].t
        self.inputs = {i.name: i for i in graph.input}

    def joined(self, tensors: list[onnx.TensorProto], name: str) -> onnx.TensorProto:
        """The initializers `tensors` side by side along their last axis, as the initializer `name`.
        Where they are all deferred (export/stream.py), so is it. Else, where the graph's weights are
        in files (`weights_from`), its bytes go to that folder's PACKED_FILE, so that the packed
        weights are never all in memory at once; `graphs.save_graph` copies them from there."""
        if all(is_deferred(t) for t in tensors):
            parts = [onnx.TensorProto() for _ in tensors]
            for part, tensor in zip(parts, tensors):
                part.CopyFrom(tensor)
            shape = [*tensors[0].dims[:-1], sum(t.dims[-1] for t in tensors)]

            def make():
                return np.concatenate([made(part) for part in parts], axis=-1)

            make.parts = parts
            return defer(name, make, shape, tensors[0].data_type)
        joined = np.concatenate([self.array(t) for t in tensors], axis=-1)
        if not self.weights_from:
            return numpy_helper.from_array(joined, name)
        with open(Path(self.weights_from) / PACKED_FILE, "ab") as out:
            offset = out.tell()
            joined.tofile(out)
        tensor = onnx.TensorProto(name=name, dims=joined.shape, data_type=onnx.helper.np_dtype_to_tensor_dtype(joined.dtype))
        refer(tensor, PACKED_FILE, offset, joined.nbytes)
        return tensor

    def array(self, tensor) -> np.ndarray:
        """A constant's values, read from the data file where the graph was loaded without them."""
        if is_deferred(tensor):
            return made(tensor)
        return numpy_helper.to_array(tensor, self.weights_from or "")

    def scalar(self, name: str) -> float | None:
        tensor = self.constants.get(name)
        if tensor is None or int(np.prod(tensor.dims)) != 1:
            return None
        return float(self.array(tensor).reshape(-1)[0])

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

    def fixed_dim(self, name: str, axis: int, what: str) -> int:
        """A graph input's dimension that must be a number."""
        dims = self.inputs[name].type.tensor_type.shape.dim
        if len(dims) <= axis or not dims[axis].dim_value:
            raise PatternError(f"{name} has no fixed {what}")
        return dims[axis].dim_value


def key_value_pairs(graph) -> list[tuple[str, str]]:
    """The (past key, past value) inputs of each attention layer, in order (a linear-attention
    layer's state inputs are not keys and values)."""
    pasts = [i.name for i in graph.input if i.name.startswith(PAST_PREFIX) and i.name.endswith((".key", ".value"))]
    if not pasts or len(pasts) % 2:
        raise PatternError("the graph has no key/value pairs of past inputs")
    return [(pasts[k], pasts[k + 1]) for k in range(0, len(pasts), 2)]


def find_layer(view: GraphView, past_key: str, past_value: str, rotary_outside: bool = False) -> LayerAttention:
    """The attention fed by one layer's past key and value; with `rotary_outside`, its query and
    key taken as rotated (a rotation GroupQueryAttention cannot do stays where it is)."""
    present_key = PRESENT_PREFIX + past_key[len(PAST_PREFIX) :]
    present_value = PRESENT_PREFIX + past_value[len(PAST_PREFIX) :]
    key_concat, value_concat = _cache_concat(view, past_key, present_key), _cache_concat(view, past_value, present_value)
    scores, key_scale = _matmul_fed_by(view, present_key)
    weighted, _ = _matmul_fed_by(view, present_value)
    query, query_scale = _query_of(view, scores)
    softmax_scale, softcap = _scores_to_weights(view, scores, weighted)
    output = _attention_output(view, weighted)
    head_size = view.fixed_dim(past_key, 3, "head size")
    if view.fixed_dim(past_value, 3, "head size") != head_size:
        raise PatternError("keys and values have different head sizes, which GroupQueryAttention does not take")
    key, value = key_concat.input[1], value_concat.input[1]
    if rotary_outside:
        projections, rotary, head_norms = [_projection(view, t) for t in (query, key, value)], None, None
    else:
        projections, rotary, head_norms = _projections(view, query, key, value, head_size)
    return LayerAttention(
        past_key,
        past_value,
        present_key,
        present_value,
        query,
        key,
        value,
        projections,
        rotary,
        output=output.output[0],
        replaced=[key_concat, value_concat, output],
        output_per_head=output.op_type == "Transpose",
        num_kv_heads=view.fixed_dim(past_key, 1, "number of KV heads"),
        head_size=head_size,
        scale=_scale(head_size, query_scale, key_scale, softmax_scale),
        head_norms=head_norms,
        softcap=softcap,
    )


def _projections(view: GraphView, query: str, key: str, value: str, head_size: int):
    """The projections behind the query, key and value, the rotary embedding that moves into
    GroupQueryAttention and the query's and key's norms over each head before it. In the usual
    pattern each projection is reshaped to heads, transposed, and the query and key are rotated by
    the same `RotaryEmbedding`; where the rotation is written out in ops (x * cos + rotate_half(x)
    * sin), x may be a norm over each head of that (`_head_norm`)."""
    rotated = [view.producer.get(t) for t in (query, key)]
    written = [_written_rotation(view, t) for t in (query, key)]
    if all(n is not None and n.op_type == "RotaryEmbedding" for n in rotated) and _same_rotary(view, *rotated, head_size):
        interleaved = next((a.i for a in rotated[0].attribute if a.name == "interleaved"), 0)
        inputs, rotary = [n.input[0] for n in rotated], Rotary(list(rotated[0].input[2:4]), interleaved)
    elif all(written) and written[0][1:] == written[1][1:]:
        inputs, rotary = [x for x, _, _ in written], Rotary(list(written[0][1:]), 0, computed=True)
    else:
        return [_projection(view, t) for t in (query, key, value)], None, None
    (query_projection, query_norm), (key_projection, key_norm) = (_unnormed(view, x, head_size) for x in inputs)
    projections = [query_projection, key_projection, _projection(view, value)]
    if all(projections) and (query_norm is None) == (key_norm is None):
        return projections, rotary, None if query_norm is None else [query_norm, key_norm]
    return [_projection(view, t) for t in (query, key, value)], None, None


def _unnormed(view: GraphView, heads_first: str, head_size: int):
    """(projection, norm): the projection that `heads_first` is a reshape and transpose of, with
    the norm over each head applied after the transpose (Gemma 3) or before it (Qwen 3), or None."""
    norm = _head_norm(view, heads_first, head_size)
    if norm is not None:
        return _projection(view, norm.input[0]), norm
    transpose = view.producer.get(heads_first)
    if transpose is not None and _is_transpose(transpose, _TO_HEADS_FIRST):
        norm = _head_norm(view, transpose.input[0], head_size)
        reshape = view.producer.get(norm.input[0]) if norm is not None else None
        if reshape is not None and reshape.op_type == "Reshape" and _is_linear(view, reshape.input[0]):
            return reshape.input[0], norm
    return _projection(view, heads_first), None


def _written_rotation(view: GraphView, rotated: str) -> tuple[str, str, str] | None:
    """(x, cos, sin) where `rotated` is x * cos + rotate_half(x) * sin written out in ops, x
    [batch, heads, seq, head] and cos and sin [batch, seq, head] tensors unsqueezed at the heads'
    axis; rotate_half(x) concatenates minus x's second half with its first half."""
    add = view.producer.get(rotated)
    muls = [view.producer.get(name) for name in add.input] if add is not None and add.op_type == "Add" else []
    if len(muls) != 2 or not all(m is not None and m.op_type == "Mul" for m in muls):
        return None
    for plain, turned in (muls, muls[::-1]):
        half = _rotated_half(view, turned)
        if half is None or half[0] not in plain.input or list(plain.input).count(half[0]) != 1:
            continue
        x, sin = half
        cos = next(name for name in plain.input if name != x)
        cos, sin = _unsqueezed_at_heads(view, cos), _unsqueezed_at_heads(view, sin)
        if cos and sin:
            return x, cos, sin
    return None


def _rotated_half(view: GraphView, mul) -> tuple[str, str] | None:
    """(x, the other factor) where one factor of `mul` is rotate_half(x)."""
    for index, name in enumerate(mul.input):
        concat = view.producer.get(name)
        if concat is None or concat.op_type != "Concat" or len(concat.input) != 2 or not _on_last_axis(concat):
            continue
        neg, first = (view.producer.get(t) for t in concat.input)
        second = view.producer.get(neg.input[0]) if neg is not None and neg.op_type == "Neg" else None
        if not (_is_head_slice(view, first, from_start=True) and _is_head_slice(view, second, from_start=False)):
            continue
        if first.input[0] == second.input[0]:
            return first.input[0], mul.input[1 - index]
    return None


def _on_last_axis(node) -> bool:
    return any(a.name == "axis" and a.i in (-1, 3) for a in node.attribute)


def _is_head_slice(view: GraphView, node, from_start: bool) -> bool:
    """`node` slices the head axis (the last), from 0 or from a position computed at run time."""
    if node is None or node.op_type != "Slice" or len(node.input) < 4:
        return False
    axes, start = view.constants.get(node.input[3]), view.scalar(node.input[1])
    if axes is None or view.array(axes).reshape(-1).tolist() not in ([-1], [3]):
        return False
    return start == 0 if from_start else start != 0


def _unsqueezed_at_heads(view: GraphView, tensor: str) -> str | None:
    node = view.producer.get(tensor)
    if node is None or node.op_type != "Unsqueeze" or len(node.input) != 2 or node.input[1] not in view.constants:
        return None
    return node.input[0] if view.array(view.constants[node.input[1]]).reshape(-1).tolist() == [1] else None


def _head_norm(view: GraphView, tensor: str, head_size: int):
    """The SimplifiedLayerNormalization over each head (its last axis, a scale of `head_size`)
    that produces `tensor`, or None."""
    node = view.producer.get(tensor)
    if node is None or node.op_type != "SimplifiedLayerNormalization" or len(node.input) != 2:
        return None
    scale = view.constants.get(node.input[1])
    axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
    return node if scale is not None and list(scale.dims) == [head_size] and axis in (-1, 3) else None


def _same_rotary(view: GraphView, a, b, head_size: int) -> bool:
    """Query and key rotated alike, over the whole head, by cos/sin caches GroupQueryAttention can take."""
    plain = all(attr.name == "interleaved" for node in (a, b) for attr in node.attribute)
    caches = view.constants.get(a.input[2]) if len(a.input) > 3 else None
    return (
        plain
        and list(a.input[1:4]) == list(b.input[1:4])
        and caches is not None
        and caches.dims[-1] * 2 == head_size
        and [x.i for x in a.attribute] == [x.i for x in b.attribute]
    )


def _projection(view: GraphView, heads_first: str) -> str | None:
    """The [batch, seq, heads * head] tensor that `heads_first` is only a reshape and transpose of."""
    transpose = view.producer.get(heads_first)
    if transpose is None or not _is_transpose(transpose, _TO_HEADS_FIRST):
        return None
    reshape = view.producer.get(transpose.input[0])
    if reshape is None or reshape.op_type != "Reshape":
        return None
    return reshape.input[0] if _is_linear(view, reshape.input[0]) else None


def _is_transpose(node, perm: list[int]) -> bool:
    return node.op_type == "Transpose" and any(a.name == "perm" and list(a.ints) == perm for a in node.attribute)


def _is_linear(view: GraphView, tensor: str) -> bool:
    """`tensor` is hidden states times a constant 2-D weight (plus a constant bias): it has the
    hidden states' [batch, seq, features] shape."""
    node = view.producer.get(tensor)
    if node is not None and node.op_type == "Add":
        node = next((view.producer.get(name) for name in node.input if name not in view.constants), None)
    weight = view.constants.get(node.input[1]) if node is not None and node.op_type == "MatMul" else None
    return weight is not None and len(weight.dims) == 2


def _scale(head_size: int, *factors: float | None) -> float:
    """The product of the constant factors; factors computed at run time (None) are taken as the
    pair scaled dot-product attention traces, 1 / sqrt(head_size) in all (the check confirms it)."""
    constant = float(np.prod([f for f in factors if f is not None]))
    return constant * (head_size**-0.5 if None in factors else 1.0)


def _cache_concat(view: GraphView, past: str, present: str):
    node = view.producer.get(present)
    if node is None or node.op_type != "Concat" or len(node.input) != 2 or node.input[0] != past:
        raise PatternError(f"{present} is not the concatenation of {past} with the new tokens")
    return node


def _matmul_fed_by(view: GraphView, cache: str):
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


def _query_of(view: GraphView, scores) -> tuple[str, float]:
    """The query going into the scores MatMul, before any scaling, and that scaling."""
    tensor, scale = scores.input[0], 1.0
    while (node := view.producer.get(tensor)) is not None and node.op_type in ("Mul", "Div"):
        scale = _times(scale, view.scale_factor(node))
        tensor = view.data_input(node)
    return tensor, scale


def _scores_to_weights(view: GraphView, scores, weighted) -> tuple[float | None, float]:
    """Check that only the mask, a scaling, a softcap and a softmax lie between the two MatMuls;
    returns the scaling and the softcap (0 for none). A softcap is cap * tanh(scores / cap), which
    GroupQueryAttention computes as its `softcap` after its `scale`: the scaling returned is the
    one before the Tanh times the cap."""
    tensor, scale, softmax, softcap = weighted.input[0], 1.0, False, 0.0
    while tensor != scores.output[0]:
        node = view.producer.get(tensor)
        if node is None:
            raise PatternError("the attention weights do not come from the scores MatMul")
        if node.op_type == "Softmax":
            softmax, tensor = True, node.input[0]
        elif node.op_type == "Tanh" and not softcap and scale is not None and scale > 0:
            softcap, scale, tensor = scale, 1.0, node.input[0]
        elif node.op_type == "Where":  # the guard against all-masked rows: Where(IsNaN(p), 0, p)
            tensor = node.input[2]
        elif node.op_type == "Add" and not softcap:  # scores + mask (after the softcap, if any)
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
    return _times(scale, softcap) if softcap else scale, softcap


def _leads_to(view: GraphView, tensor: str, target: str, depth: int = 4) -> bool:
    if tensor == target:
        return True
    node = view.producer.get(tensor)
    return depth > 0 and node is not None and any(_leads_to(view, name, target, depth - 1) for name in node.input)


def _attention_output(view: GraphView, weighted):
    """The Reshape that turns the attention output [batch, heads, seq, head] into [batch, seq, hidden]
    (or the Transpose to [batch, seq, heads, head], where a gate per head multiplies that first).
    A Reshape may come first, one whose target shape is computed from the output's own (a Shape
    of it): it merges the [batch, kv heads, group, seq, head] of attention computed per KV head
    (Qwen 3.5's) into [batch, heads, seq, head], heads in GroupQueryAttention's order."""
    consumers = [c for c in view.consumers[weighted.output[0]] if c.op_type != "Shape"]
    if len(consumers) == 1 and consumers[0].op_type == "Reshape":
        consumers = view.consumers[consumers[0].output[0]]
    transpose = consumers[0] if len(consumers) == 1 else None
    if transpose is None or not _is_transpose(transpose, _TO_HEADS_FIRST):
        raise PatternError(f"the output of {weighted.name} is not transposed to [batch, seq, heads, head]")
    consumers = view.consumers[transpose.output[0]]
    if len(consumers) == 1 and consumers[0].op_type == "Mul":  # a gate per head (LFM 3's) on [batch, seq, heads, head]
        return transpose
    if len(consumers) != 1 or consumers[0].op_type != "Reshape":
        raise PatternError(f"the output of {transpose.name} is not reshaped to [batch, seq, hidden]")
    return consumers[0]
