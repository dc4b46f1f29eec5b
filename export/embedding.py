"""`edgeinfer export --task embedding`: a causal LM's hidden states for embeddings.

The graph is the model without its lm_head (export/trace.py's `trace_hidden`): token ids,
mask and positions in, `last_hidden_state` out, no KV cache. How a text's vector is made comes from
the model's sentence-transformers config where it has one (`modules.json`: a Pooling module's
`pooling_mode_lasttoken` or `pooling_mode_mean_tokens`, and a Normalize module), else last-token
pooling, normalized (what causal-LM embedding models use); `--pooling` overrides it. The export is
checked against transformers on the same checkpoint: every check text's vector, alone and in a
padded batch, within cosine 0.9999.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edgeinfer.sdk.errors import ExportError

# Texts of different lengths, so that a batch pads some rows.
CHECK_TEXTS = [
    "The capital of France is Paris.",
    "Edge boxes run small language models close to their users.",
    "ONNX Runtime executes graphs on CPUs and GPUs; the KV cache keeps past keys and values.",
    "Hi",
]
MIN_COSINE = 0.9999


def pooling_config(folder: Path | None, requested: str | None) -> dict:
    """{"pooling", "normalize", "from"}: the sentence-transformers config of the model in `folder`
    where it has one, `requested` (last or mean) over its pooling."""
    modules = _read(folder / "modules.json") if folder else None
    pooling, normalize, source = "last", True, "the default: no sentence-transformers config"
    if isinstance(modules, list):
        kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
        normalize, source = "Normalize" in kinds, "sentence-transformers config"
        settings = _read(folder / kinds["Pooling"].get("path", "") / "config.json") if "Pooling" in kinds else None
        if isinstance(settings, dict) and requested is None:
            pooling = _pooling_mode(settings, folder)
    if requested is not None:
        if requested not in ("last", "mean"):
            raise ExportError(f"--pooling must be 'last' or 'mean', got {requested!r}")
        pooling, source = (
            requested,
            f"--pooling {requested}" + ("" if source.startswith("the default") else f", normalize from the {source}"),
        )
    return {"pooling": pooling, "normalize": normalize, "from": source}


def _pooling_mode(settings: dict, folder: Path) -> str:
    if settings.get("pooling_mode_lasttoken"):
        return "last"
    if settings.get("pooling_mode_mean_tokens"):
        return "mean"
    chosen = [k for k, v in settings.items() if k.startswith("pooling_mode_") and v]
    raise ExportError(
        f"{folder}'s sentence-transformers Pooling uses {', '.join(chosen) or 'no mode'}, which edgeinfer does not compute: "
        "it pools by the last token or the mean; pass --pooling last or mean to choose one knowingly"
    )


def _read(path: Path):
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None


def base_model(model):
    """The model without its lm_head (what transformers' AutoModel loads)."""
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        raise ExportError(f"the {model.config.model_type} model has no base model apart from its head: it cannot give hidden states")
    return base


def torch_embeddings(base, tokenizer, texts: list[str], pooling: str, normalize: bool) -> np.ndarray:
    """transformers' vectors of `texts`, each alone: the last hidden state pooled (and normalized)."""
    import torch

    from edgeinfer.sdk.embedder import normalized, pool

    vectors = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            hidden = base(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state.float().numpy()
            vectors.append(pool(hidden, np.ones(ids.shape, np.int64), pooling)[0])
    vectors = np.stack(vectors)
    return normalized(vectors) if normalize else vectors


def check(folder: Path, reference: np.ndarray) -> dict:
    """The export's vectors of CHECK_TEXTS, in one batch and each alone, against `reference`."""
    from edgeinfer.sdk.engine import Engine

    embedder = Engine.load(folder, provider="cpu", max_batch=len(CHECK_TEXTS))
    together = embedder.embed(CHECK_TEXTS).vectors
    alone = np.stack([embedder.embed(text).vectors[0] for text in CHECK_TEXTS])
    cosine = lambda a, b: (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)  # noqa: E731
    result = {
        "texts": len(CHECK_TEXTS),
        "cosine_min": float(min(cosine(together, reference).min(), cosine(alone, reference).min())),
        "max_abs_diff": float(np.abs(together - reference).max()),
        "batch_max_abs_diff": float(np.abs(together - alone).max()),
        "min_cosine": MIN_COSINE,
    }
    if result["cosine_min"] < MIN_COSINE:
        raise ExportError(
            f"the embedding graph's vectors differ from transformers': cosine {result['cosine_min']:.6f} (at least {MIN_COSINE} "
            "needed): the export is not valid; please report it with the model's name"
        )
    return result
