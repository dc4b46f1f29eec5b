"""Export's check: the graph, run through edgeinfer's own runtime, against the PyTorch model.

PyTorch's side of every check is computed once, into a `Reference`, so that export can let the
PyTorch model go once the graph is traced: the checks that follow then hold ONNX Runtime's copy
of the weights alone, not both (the export's peak memory)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgeinfer.sdk.engine import Engine
from edgeinfer.sdk.errors import ExportError

SAMPLE_TOKENS = 16
EXTEND_TOKENS = 4
# Largest logits difference accepted, relative to the largest reference logit (at least 1), by the
# export's dtype: float16 keeps about 3 significant digits per op, and the errors add up over layers.
RELATIVE_TOLERANCE = {"float32": 1e-3, "float16": 2e-2}


@dataclass(frozen=True)
class Reference:
    """What PyTorch computes for a prompt `ids`: its greedy tokens after it, and the logits at the
    prompt's last position (prefill), after the first greedy token (decode), and at each of
    EXTEND_TOKENS more positions after that (the prompt's first tokens again: speculative
    decoding's several-token pass)."""

    ids: list[int]
    greedy: list[int]
    prefill: np.ndarray
    decode: np.ndarray
    extend: np.ndarray


def torch_reference(model, ids: list[int], new_tokens: int = 1) -> Reference:
    """`model`'s Reference for `ids`, with `new_tokens` greedy tokens."""
    import torch

    greedy = transformers_greedy(model, ids, max(1, new_tokens))
    with torch.no_grad():
        logits = model(torch.tensor([ids + greedy[:1] + ids[:EXTEND_TOKENS]])).logits[0].float().numpy()
    return Reference(
        ids=list(ids),
        greedy=greedy[:new_tokens],
        prefill=logits[len(ids) - 1].copy(),
        decode=logits[len(ids)].copy(),
        extend=logits[len(ids) + 1 :].copy(),
    )


def transformers_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy tokens after `ids`, exactly `new_tokens` of them: the model's forward
    with its own KV cache, the largest logit each step (`generate` would stop at, or suppress, EOS).
    A model whose output carries no cache (RecurrentGemma's, which keeps its states on its
    modules) reads the whole text again at each step, without a cache."""
    import torch

    tokens, past, new_ids = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(new_ids, cache=past, use_cache=not tokens or past is not None)
            tokens.append(int(out.logits[0, -1].argmax()))
            past = getattr(out, "cache", None)
            new_ids = torch.tensor([[tokens[-1]]] if past is not None else [ids + tokens])
    return tokens


def sample_ids(vocab_size: int) -> list[int]:
    """The validation's fixed random prompt."""
    return np.random.default_rng(0).integers(0, vocab_size, SAMPLE_TOKENS).tolist()


def validate(reference: Reference, folder: Path) -> dict:
    """Prefill the reference's prompt (`sample_ids`), decode one token and extend by a few, in ONNX
    Runtime (CPU); return the largest logits differences from PyTorch's, or raise if they are above
    tolerance."""
    engine = Engine.load(folder, provider="cpu")
    result = {"sample_tokens": len(reference.ids), **logits_differences(engine, reference)}
    worst = max(result["max_abs_diff_prefill"], result["max_abs_diff_decode"], result["max_abs_diff_extend"])
    result["passed"] = worst <= result["tolerance"]
    if not result["passed"]:
        raise ExportError(
            f"the ONNX graphs differ from PyTorch by {worst:.3g} in the logits (tolerance {result['tolerance']:.3g}): the export is not valid"
        )
    return result


def logits_differences(engine: Engine, reference: Reference, adapter: str | None = None) -> dict:
    """Largest absolute differences between the engine's logits and the reference's: at the
    prompt's last position (prefill), for PyTorch's first greedy token (decode), and for every
    position of a pass of EXTEND_TOKENS more; and the tolerance for them."""
    ids, token = reference.ids, reference.greedy[0]
    cache = engine.runner.new_batch()
    engine.runner.assign(cache, 0, adapter)
    onnx_prefill = engine.runner.prefill(cache, [ids]).numpy()[0, -1].astype(np.float32)
    onnx_decode = engine.runner.decode(cache, [token]).numpy()[0, -1].astype(np.float32)
    onnx_extend = engine.runner.verify(cache, 0, ids[:EXTEND_TOKENS]).numpy()[0].astype(np.float32)
    return {
        "max_abs_diff_prefill": float(np.abs(onnx_prefill - reference.prefill).max()),
        "max_abs_diff_decode": float(np.abs(onnx_decode - reference.decode).max()),
        "max_abs_diff_extend": float(np.abs(onnx_extend - reference.extend).max()),
        "tolerance": RELATIVE_TOLERANCE[engine.manifest.dtype] * max(1.0, float(np.abs(reference.prefill).max())),
    }
