"""Which modules a 4-bit export keeps at 8 bits when `--keep-int8 auto`: each module's cost measured
end to end, not guessed from its weights. The fp32 export runs the first `TOKENS` of the
calibration text once exactly, and once per module (qkv_proj, o_proj, gate_up_proj, ..., lm_head)
with that module's weights in every layer rounded to 4 bits and the rest exact; the mean KL
divergence of those next-token distributions from the exact ones is the module's cost. Modules are
kept at 8 bits in order of cost per byte added, while what they add stays within `BUDGET` of the
all-4-bit MatMul weights. (A module's share of a weight-only error is a poor guide: rounding the
lm_head moves its outputs least of all, relative to their size, and the logits most.)"""

from __future__ import annotations

import mmap
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx

from edgeinfer.sdk.manifest import load_manifest
from edgeinfer.sdk.runtime import Graph

from .calibration import WINDOW, window_feeds
from .graphs import GRAPH_FILE, tensor_array, tied_embedding

TOKENS = 2 * WINDOW
BUDGET = 0.3  # 8-bit modules may add this fraction of the 4-bit MatMul weights' bytes
_GRAPH = "sensitivity.onnx"  # the export's graph with the MatMul weights as inputs, while it runs


def modules_by_cost(export: Path, ids: list[int], role, rounded, fit=None) -> list[tuple[str, float, int]]:
    """(module, mean KL divergence with it at 4 bits, bytes 8 bits add), costliest per byte first.
    `role(node name)` gives a MatMul's (layer, module); `rounded(weight, input name, weight name)`
    the values a weight [K, N] stands for at 4 bits, as the export will round it; `fit` (same
    arguments), where given, is called on each weight alone first, before the measure holds them
    all and its session (a search's working memory beside its own, not theirs), with a copy of
    its own that it may work in."""
    model = onnx.load(str(export / GRAPH_FILE), load_external_data=False)
    inputs = _module_weights(model.graph, role)
    weights = {module: list(pairs) for module, pairs in inputs.items()}
    tied = tied_embedding(model.graph, export)
    names = [name for group in weights.values() for name in group]
    tensors = {t.name: t for t in model.graph.initializer}
    for module, group in weights.items() if fit else ():
        for name in group:
            fit(tensor_array(tensors[name], export, mapped=False), inputs[module][name], name)
    exact = {name: np.asarray(tensor_array(tensors[name], export)) for name in names}  # mapped from the data file
    _weights_as_inputs(model, names)
    if tied:  # a tied table is read through its lm_head, not held a second time
        _gather_from_head(model, tied[0], tied[1])
    onnx.save(model, str(export / _GRAPH))
    try:
        graph = Graph(export / _GRAPH, "cpu", None, packed=False)
        manifest = load_manifest(export)
        windows = [ids[start : start + WINDOW] for start in range(0, min(len(ids), TOKENS), WINDOW)]
        reference = [_log_probs(graph, manifest, window, exact) for window in windows]
        costs = []
        for module, group in weights.items():
            for name in group:  # rounded in place of the exact weight, mapped again after
                weight = exact.pop(name)
                _let_go_of_pages(weight)  # (mapped again if the rounding reads it)
                exact[name] = rounded(weight, inputs[module][name], name).astype(weight.dtype, copy=False)
                del weight
            kld = np.mean([_kld(ref, _log_probs(graph, manifest, w, exact)) for ref, w in zip(reference, windows)])
            costs.append((module, float(kld), sum(exact[name].size for name in group) // 2))
            exact.update({name: np.asarray(tensor_array(tensors[name], export)) for name in group})
    finally:
        (export / _GRAPH).unlink(missing_ok=True)
    return sorted(costs, key=lambda cost: cost[1] / cost[2], reverse=True)


def chosen(costs: list[tuple[str, float, int]], block: int) -> list[str]:
    """The modules kept at 8 bits: costliest per byte first, while they fit the budget."""
    four_bit = sum(extra * 2 for _, _, extra in costs) * (4 + 36 / block) / 8  # levels, fp32 scales, 4-bit zeros
    kept, added = [], 0
    for module, _, extra in sorted(costs, key=lambda cost: cost[1] / cost[2], reverse=True):
        if added + extra <= BUDGET * four_bit:
            kept.append(module)
            added += extra
    return kept


def _let_go_of_pages(array: np.ndarray) -> None:
    """Drop the resident pages of `array` where it is mapped from a file: they are read again where touched."""
    mapping = getattr(array if isinstance(array, np.memmap) else array.base, "_mmap", None)
    if mapping is not None:
        mapping.madvise(mmap.MADV_DONTNEED)


def _module_weights(graph: onnx.GraphProto, role) -> dict[str, dict[str, str]]:
    """{module: {weight name: input name}} of the MatMuls with a constant weight [K, N] (the
    quantizer's: a batched weight, experts' [experts, K, N], stays as it is)."""
    initializers = {t.name for t in graph.initializer if len(t.dims) == 2}
    groups = defaultdict(dict)
    for node in graph.node:
        if node.op_type == "MatMul" and node.input[1] in initializers:
            groups[role(node.name)[1]][node.input[1]] = node.input[0]
    return dict(groups)


def _weights_as_inputs(model: onnx.ModelProto, names: list[str]) -> None:
    chosen = set(names)
    kept = [t for t in model.graph.initializer if t.name not in chosen]
    inputs = [
        onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in model.graph.initializer if t.name in chosen
    ]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    model.graph.input.extend(inputs)


def _gather_from_head(model: onnx.ModelProto, gather: onnx.NodeProto, head: str) -> None:
    """The embedding's `gather` of table rows [vocab, hidden] made a Gather of the tied lm_head
    weight's columns, `head` [hidden, vocab], transposed back ([hidden, *ids] to [*ids, hidden]):
    the table is never made."""
    table, ids, out = gather.input[0], gather.input[1], gather.output[0]
    kept = [t for t in model.graph.initializer if t.name != table]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    rank = next(len(i.type.tensor_type.shape.dim) for i in model.graph.input if i.name == ids)
    at = list(model.graph.node).index(gather)
    model.graph.node.remove(gather)
    columns = onnx.helper.make_node("Gather", [head, ids], [f"{out}_columns"], name="edgeinfer_tied_columns", axis=1)
    back = onnx.helper.make_node("Transpose", [f"{out}_columns"], [out], name="edgeinfer_tied_rows", perm=[*range(1, rank + 1), 0])
    model.graph.node.insert(at, back)
    model.graph.node.insert(at, columns)


def rounded_to_nearest(weight: np.ndarray, block: int) -> np.ndarray:
    """`weight` [K, N] rounded to 4 bits in blocks of `block` along K (min-max, a zero point each),
    as the values the blocks stand for."""
    rows, cols = weight.shape
    padded = np.zeros((-(-rows // block) * block, cols), np.float32)
    padded[:rows] = weight
    x = padded.T.reshape(cols, -1, block)
    low, high = np.minimum(x.min(-1, keepdims=True), 0), np.maximum(x.max(-1, keepdims=True), 0)
    scale = np.where(high > low, (high - low) / 15, 1)
    zero = np.round(-low / scale)
    values = (np.clip(np.round(x / scale) + zero, 0, 15) - zero) * scale
    return np.ascontiguousarray(values.reshape(cols, -1).T[:rows])


def _log_probs(graph: Graph, manifest, window: list[int], weights: dict) -> np.ndarray:
    feeds = {**window_feeds(graph, manifest, [window], logits=len(window)), **weights}
    _, outputs = graph.run(feeds, on_device=[], to_host=["logits"])
    logits = outputs.pop("logits")[0]
    out = np.empty(logits.shape, np.float32)
    for rows in _row_chunks(len(logits)):  # (a chunk's temporaries, not the whole window's)
        part = logits[rows].astype(np.float32)
        part -= part.max(-1, keepdims=True)
        out[rows] = part - np.log(np.exp(part).sum(-1, keepdims=True))
    return out


def _kld(reference: np.ndarray, other: np.ndarray) -> float:
    sums = [np.sum(np.exp(reference[rows]) * (reference[rows] - other[rows]), -1) for rows in _row_chunks(len(reference))]
    return float(np.mean(np.concatenate(sums)))


def _row_chunks(rows: int, size: int = 32) -> list[slice]:
    return [slice(start, start + size) for start in range(0, rows, size)]
