"""Export's check: the graph, run through edgeinfer's own runtime, against the PyTorch model."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from edgeinfer.sdk.engine import Engine
from edgeinfer.sdk.errors import ExportError

SAMPLE_TOKENS = 16
EXTEND_TOKENS = 4
# Largest logits difference accepted, relative to the largest reference logit (at least 1), by the
# export's dtype: float16 keeps about 3 significant digits per op, and the errors add up over layers.
RELATIVE_TOLERANCE = {"float32": 1e-3, "float16": 2e-2}


def validate(model, folder: Path) -> dict:
    """Prefill a fixed random prompt and decode one token, in ONNX Runtime (CPU) and in PyTorch;
    return the largest logits differences, or raise if they are above tolerance."""
    engine = Engine.load(folder, provider="cpu")
    ids = np.random.default_rng(0).integers(0, engine.manifest.vocab_size, SAMPLE_TOKENS).tolist()
    result = {"sample_tokens": SAMPLE_TOKENS, **logits_differences(engine, model, ids)}
    worst = max(result["max_abs_diff_prefill"], result["max_abs_diff_decode"], result["max_abs_diff_extend"])
    result["passed"] = worst <= result["tolerance"]
    if not result["passed"]:
        raise ExportError(f"the ONNX graphs differ from PyTorch by {worst:.3g} in the logits (tolerance {result['tolerance']:.3g}): the export is not valid")
    return result


def logits_differences(engine: Engine, model, ids: list[int]) -> dict:
    """Largest absolute differences between the engine's and PyTorch's logits at the prompt's last
    position (prefill), for one decoded token, and for every position of a pass of EXTEND_TOKENS
    more (speculative decoding's check), and the tolerance for them."""
    import torch

    cache = engine.new_cache()
    onnx_prefill = engine.prefill([ids], cache).numpy()[0, -1].astype(np.float32)
    token = int(np.argmax(onnx_prefill))
    onnx_decode = engine.decode([token], cache).numpy()[0, -1].astype(np.float32)
    more = ids[:EXTEND_TOKENS]
    onnx_extend = engine.extend(more, cache).numpy()[0].astype(np.float32)
    with torch.no_grad():
        out = model(torch.tensor([ids + [token] + more]))
    reference = out.logits[0].float().numpy()
    ref_prefill, ref_decode, ref_extend = reference[len(ids) - 1], reference[len(ids)], reference[-EXTEND_TOKENS:]
    return {
        "max_abs_diff_prefill": float(np.abs(onnx_prefill - ref_prefill).max()),
        "max_abs_diff_decode": float(np.abs(onnx_decode - ref_decode).max()),
        "max_abs_diff_extend": float(np.abs(onnx_extend - ref_extend).max()),
        "tolerance": RELATIVE_TOLERANCE[engine.manifest.dtype] * max(1.0, float(np.abs(ref_prefill).max())),
    }
