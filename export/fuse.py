"""Fusing the exported graph: ONNX Runtime's transformer optimizer (optimize.py: rotary embeddings, skip +
(RMS) layer norms and GELUs become single contrib ops: `RotaryEmbedding`,
`SkipSimplifiedLayerNormalization`, ...), then each layer's attention rewritten to
`GroupQueryAttention` with the KV cache written in place (attention.py), and the MatMuls that read
one input packed into one (pack.py: the MLP's gate and up projections). The graph written is
already optimized, so it loads faster.

A fused graph is kept only if it passes the same checks as the export (logits against PyTorch,
greedy tokens, and a batch against single prompts). Where the attention rewrite does not apply or
does not pass, the optimizer's graph alone is tried; where that fails too, export keeps the
unfused graph. The manifest says what was kept and why. Only the errors that mean "does not apply"
(PatternError) or "does not load or run" (the runtime's own errors) lead to a fallback; any other
error is a bug, and fails the export (export/progress.py says so in one line, naming the stage).
"""

from __future__ import annotations

import collections
import dataclasses
import shutil
from pathlib import Path

import onnx

from edgeinfer.sdk.errors import ExportError, GenerationError, GraphError, ManifestError, NotAnExportError
from edgeinfer.sdk.manifest import WINDOWS_FORMAT_VERSION, GraphSpec, Manifest
from edgeinfer.sdk.memory import give_back_freed_memory

from .attention import PatternError, cached_windows, layer_windows, rewrite_attention
from .attention_pattern import PACKED_FILE
from .check import check_against
from .graphs import GRAPH_FILE, save_graph
from .optimize import load_without_weights, optimize
from .pack import pack_shared_inputs
from .source import first_line
from .validate import Reference

CHECK_PROMPT = list(range(3, 43))
CHECK_TOKENS = 8
# What the runtime raises when a fused graph does not load (ONNX Runtime refuses it, or its inputs
# are not the manifest's) or does not run.
_DOES_NOT_RUN = (NotAnExportError, ManifestError, GraphError, GenerationError)  # GenerationError: a batch it cannot run


def fuse_graph(
    folder: Path,
    config,
    reference: Reference | None,
    manifest: Manifest,
    progress=lambda doing, fraction=None: None,
    like: dict | None = None,
) -> tuple[dict, Manifest]:
    """Replace the graph in `folder` by its fused form where that checks out against PyTorch's
    `reference` (of CHECK_PROMPT, CHECK_TOKENS tokens); returns what was fused (or why not) and the manifest of
    the graph kept. `config` is the model's; `progress` hears what it is doing. Without a
    reference (a streamed export), the graph kept is of the kind the check copy kept (`like`, its
    fusion entry), unchecked: the check copy's was checked."""
    try:
        return _fused(folder, config, reference, manifest, progress, like)
    finally:
        (folder / PACKED_FILE).unlink(missing_ok=True)


def _fused(folder: Path, config, reference: Reference | None, manifest: Manifest, progress, like: dict | None):
    heads, hidden = getattr(config, "num_attention_heads", 0) or 0, getattr(config, "hidden_size", 0) or 0
    if (
        not manifest.kv.num_layers or not heads or hidden % heads
    ):  # no attention layer (Mamba's): the optimizer's attention fusions have none to find
        heads = hidden = 0
    optimized = optimize(load_without_weights(folder / GRAPH_FILE), heads, hidden, progress=progress)
    _trim_rotary_caches(optimized.graph, manifest.max_context)
    progress("rewriting attention to GroupQueryAttention")
    rewritten, why_not = _rewrite(optimized, config, manifest, folder)
    if reference is None:
        return _fused_like(folder, optimized, rewritten, why_not, manifest, like)
    if rewritten is not None:
        progress("checking the fused graph against PyTorch: logits, tokens, a batch")
        in_place = _in_place(manifest, rewritten)
        problem = _try(folder, rewritten, reference, in_place)
        if problem is None:
            return {"fused": _contrib_ops(rewritten)}, in_place
        why_not = f"attention kept as exported: the graph with GroupQueryAttention{problem.removeprefix('the fused graph')}"
    progress("checking the optimizer's graph against PyTorch: logits, tokens, a batch")
    problem = _try(folder, optimized, reference, manifest)
    if problem:
        return {"fused": {}, "skipped": problem, "attention": why_not}, manifest
    return {"fused": _contrib_ops(optimized), "attention": why_not}, manifest


def _fused_like(folder: Path, optimized, rewritten, why_not: str | None, manifest: Manifest, like: dict) -> tuple[dict, Manifest]:
    """The graph of the kind the check copy kept (`like`): GroupQueryAttention, the optimizer's
    graph, or the graph as exported."""
    if "GroupQueryAttention" in like["fused"]:
        if rewritten is None:
            raise ExportError(
                f"the check copy's attention became GroupQueryAttention and the whole model's cannot ({why_not}): "
                "this is a bug in edgeinfer, please report it; --no-fuse exports without fusing"
            )
        in_place = _in_place(manifest, rewritten)
        _try(folder, rewritten, None, in_place)
        return {"fused": _contrib_ops(rewritten)}, in_place
    if like["fused"]:
        _try(folder, optimized, None, manifest)
        return {"fused": _contrib_ops(optimized), "attention": like.get("attention")}, manifest
    return dict(like), manifest


def _rewrite(optimized: onnx.ModelProto, config, manifest: Manifest, folder: Path) -> tuple[onnx.ModelProto | None, str | None]:
    """A copy of the optimizer's graph with GroupQueryAttention and the MatMuls that share an input
    packed (pack.py), or None and why not (the weights it packs are read from `folder`'s data file)."""
    if not manifest.kv.num_layers:
        return None, "no attention layers to rewrite"
    why_traced = _kept_as_traced(manifest.vision)
    if why_traced:
        return None, f"attention kept as exported: {why_traced}"
    rewritten = _copy(optimized)
    try:
        num_heads = getattr(config, "num_attention_heads", None)
        if not num_heads:
            raise PatternError(f"the {config.model_type} config names no num_attention_heads")
        rewrite_attention(
            rewritten,
            num_heads,
            layer_windows(config, manifest.kv.num_layers),
            manifest.max_context,
            weights_from=folder,
            rotary_outside=manifest.vision.get("rotary") == "3d",
        )
        pack_shared_inputs(rewritten, weights_from=folder)
    except PatternError as e:
        return None, f"attention kept as exported: {first_line(e)}"
    return rewritten, None


def _kept_as_traced(vision: dict) -> str | None:
    """Why a vision-language model's attention cannot be GroupQueryAttention, which is causal; None
    where it can (3-D rotary positions stay in the graph: rewrite_attention's rotary_outside)."""
    if vision.get("attention") == "bidirectional":
        return "a picture's tokens attend to each other both ways, which GroupQueryAttention does not do"
    return None


def _try(folder: Path, graph: onnx.ModelProto, reference: Reference | None, manifest: Manifest) -> str | None:
    """Put `graph` in place of the export's graph if it passes the checks (none without a
    `reference`); else why not."""
    trial = folder / ".fused"
    trial.mkdir()
    try:
        graph = _copy(graph)  # saving points its tensors at the trial's data file
        save_graph(graph, trial, weights_from=folder)
        for name in folder.iterdir():  # the fused graph is loaded beside the export's other files
            if name.is_file() and not name.name.startswith(GRAPH_FILE):
                shutil.copy(name, trial / name.name)
        manifest.save(trial)
        give_back_freed_memory()  # what the optimizer and the rewrite freed, before the check's session loads
        problem = None if reference is None else _check(trial, reference)
        if problem is None:
            for name in (GRAPH_FILE, f"{GRAPH_FILE}.data"):
                (trial / name).replace(folder / name)
        return problem
    finally:
        shutil.rmtree(trial, ignore_errors=True)


def _copy(graph: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(graph)
    return copy


def _in_place(manifest: Manifest, rewritten: onnx.ModelProto) -> Manifest:
    """The manifest of the graph with GroupQueryAttention: its inputs, its cache written in place,
    and the layers whose cache keeps only their window."""
    windows = cached_windows(rewritten, manifest.kv.past)
    version = max(manifest.format_version, WINDOWS_FORMAT_VERSION) if windows else manifest.format_version
    kv = dataclasses.replace(manifest.kv, in_place=True, windows=windows)
    return dataclasses.replace(manifest, kv=kv, graph=_graph_spec(rewritten), format_version=version)


def _graph_spec(graph: onnx.ModelProto) -> GraphSpec:
    return GraphSpec(file=GRAPH_FILE, inputs=[i.name for i in graph.graph.input], outputs=[o.name for o in graph.graph.output])


def _contrib_ops(graph: onnx.ModelProto) -> dict[str, int]:
    counts = collections.Counter(n.op_type for n in graph.graph.node if n.domain == "com.microsoft")
    return dict(sorted(counts.items()))


def _trim_rotary_caches(graph, max_context: int) -> None:
    """The optimizer sizes RotaryEmbedding's cos/sin caches for 131,072 positions; positions past
    the export's context are never read, so they are cut to it."""
    from onnx import numpy_helper

    names = {n.input[i] for n in graph.node if n.op_type == "RotaryEmbedding" for i in (2, 3) if len(n.input) > i}
    for index, tensor in enumerate(graph.initializer):
        if tensor.name in names and tensor.dims and tensor.dims[0] > max_context:
            array = numpy_helper.to_array(tensor)[:max_context]
            graph.initializer[index].CopyFrom(numpy_helper.from_array(array, tensor.name))


def _check(fused: Path, reference: Reference) -> str | None:
    """Why the fused graph cannot be used, or None: the parity check of `edgeinfer check`."""
    try:
        result = check_against(fused, reference)
    except _DOES_NOT_RUN as e:
        return f"the fused graph fails to run: {first_line(e)}"
    worst = result.worst
    if worst > result.tolerance:
        return f"the fused graph's logits differ from PyTorch by {worst:.3g} (tolerance {result.tolerance:.3g})"
    if not result.tokens_equal:
        return "the fused graph's greedy tokens differ from PyTorch's"
    if not result.batch_rows_equal_single:
        return "the fused graph's batch rows differ from single prompts"
    return None
