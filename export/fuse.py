"""Fusing the exported graph with ONNX Runtime's transformer optimizer: rotary embeddings, skip +
(RMS) layer norms and GELUs become single contrib ops (`RotaryEmbedding`,
`SkipSimplifiedLayerNormalization`, ...), and the graph it writes is already optimized, so it loads
faster. A fused graph is kept only if it passes the same checks as the export (logits against
PyTorch, and a batch against single prompts); otherwise export keeps the unfused graph and says why.
"""
from __future__ import annotations

import collections
import shutil
from pathlib import Path

import onnx

from edgeinfer.sdk.engine import Engine
from edgeinfer.sdk.settings import GenerationConfig

from .graphs import GRAPH_FILE
from .validate import logits_differences

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
        problem = _check(folder, fused_dir, model)
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


def _check(unfused: Path, fused: Path, model) -> str | None:
    """Why the fused graph cannot be used, or None."""
    greedy = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    prompts = [CHECK_PROMPT[:5], CHECK_PROMPT]
    try:  # any failure of the fused graph only means the unfused one is kept
        engine = Engine.load(fused, provider="cpu")
        differences = logits_differences(engine, model, CHECK_PROMPT)
        rows = [r.token_ids for r in engine.generate(prompts, greedy)]
    except Exception as e:  # noqa: BLE001
        return f"the fused graph fails to run: {str(e).splitlines()[0][:200]}"
    worst = max(differences["max_abs_diff_prefill"], differences["max_abs_diff_decode"])
    if worst > differences["tolerance"]:
        return f"the fused graph's logits differ from PyTorch by {worst:.3g} (tolerance {differences['tolerance']:.3g})"
    reference = Engine.load(unfused, provider="cpu")
    if rows != [reference.generate(p, greedy).token_ids for p in prompts]:
        return "the fused graph's batch rows differ from single prompts"
    return None
