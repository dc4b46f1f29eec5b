"""Fusing the exported graph with ONNX Runtime's transformer optimizer: rotary embeddings, skip +
(RMS) layer norms and GELUs become single contrib ops (`RotaryEmbedding`,
`SkipSimplifiedLayerNormalization`, ...), and the graph it writes is already optimized, so it loads
faster. A fused graph is kept only if it passes the same checks as the export (logits against
PyTorch, greedy tokens and a batch against single prompts); otherwise export keeps the unfused graph and says why.
"""
from __future__ import annotations

import collections
import shutil
from pathlib import Path

import onnx

from .check import check_export
from .graphs import GRAPH_FILE
from .source import first_line

CHECK_PROMPT = list(range(3, 43))


def fuse_graph(folder: Path, model, max_context: int) -> dict:
    """Replace the graph in `folder` by its fused form if that checks out; returns what was fused,
    or why nothing was."""
    from onnxruntime.transformers import optimizer

    fused_dir = folder / ".fused"
    fused_dir.mkdir()
    try:
        config = model.config
        optimized = optimizer.optimize_model(str(folder / GRAPH_FILE), model_type="gpt2", opt_level=0, use_gpu=False,
                                             num_heads=getattr(config, "num_attention_heads", 0) or 0,
                                             hidden_size=getattr(config, "hidden_size", 0) or 0)
        _trim_rotary_caches(optimized.model.graph, max_context)
        onnx.save(optimized.model, str(fused_dir / GRAPH_FILE), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=f"{GRAPH_FILE}.data", size_threshold=1024)
        counts = collections.Counter(n.op_type for n in optimized.model.graph.node if n.domain == "com.microsoft")
        for name in folder.iterdir():  # the fused graph is loaded beside the export's other files
            if name.is_file() and not name.name.startswith(GRAPH_FILE):
                shutil.copy(name, fused_dir / name.name)
        problem = _check(fused_dir, model)
        if problem:
            return {"fused": {}, "skipped": problem}
        for name in (GRAPH_FILE, f"{GRAPH_FILE}.data"):
            (fused_dir / name).replace(folder / name)
        return {"fused": dict(sorted(counts.items()))}
    finally:
        shutil.rmtree(fused_dir, ignore_errors=True)


def _trim_rotary_caches(graph, max_context: int) -> None:
    """The optimizer sizes RotaryEmbedding's cos/sin caches for 131,072 positions (34 MB for
    SmolLM2); positions past the export's context are never read."""
    from onnx import numpy_helper

    names = {n.input[i] for n in graph.node if n.op_type == "RotaryEmbedding" for i in (2, 3) if len(n.input) > i}
    for index, tensor in enumerate(graph.initializer):
        if tensor.name in names and tensor.dims and tensor.dims[0] > max_context:
            array = numpy_helper.to_array(tensor)[:max_context]
            graph.initializer[index].CopyFrom(numpy_helper.from_array(array, tensor.name))


def _check(fused: Path, model) -> str | None:
    """Why the fused graph cannot be used, or None: the parity check of `edgeinfer check`."""
    try:  # any failure of the fused graph only means the unfused one is kept
        result = check_export(fused, model, CHECK_PROMPT, new_tokens=8)
    except Exception as e:  # noqa: BLE001
        return f"the fused graph fails to run: {first_line(e)}"
    worst = max(result.max_abs_diff_prefill, result.max_abs_diff_decode)
    if worst > result.tolerance:
        return f"the fused graph's logits differ from PyTorch by {worst:.3g} (tolerance {result.tolerance:.3g})"
    if not result.tokens_equal:
        return "the fused graph's greedy tokens differ from PyTorch's"
    if not result.batch_rows_equal_single:
        return "the fused graph's batch rows differ from single prompts"
    return None
