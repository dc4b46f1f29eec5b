"""Embeddings from an export of a causal LM's hidden states (`edgeinfer export --task embedding`).

The graph gives the last hidden state of every position; a text's embedding is the state of its
last token, or the mean over its tokens, as the manifest's `embedding.pooling` says (the model's
sentence-transformers config, at export), L2-normalized where `embedding.normalize` says so.
Texts are run in batches of similar length, right-padded: with causal attention a padded row's
real positions see only real tokens, so a text's embedding does not depend on its batch.
"""

from __future__ import annotations

import base64
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CancelledRequestError, ContextLengthError, SettingsError
from .manifest import Manifest
from .runtime import Graph, RuntimeOptions, choose_provider
from .tokenizer import Tokenizer

POOLINGS = ("last", "mean")
NOT_GENERATING = (
    "this model embeds text (it was exported with task='embedding'); it does not generate: use embed(), or "
    "export the model without task='embedding' to generate"
)


@dataclass
class Embeddings:
    """One vector per text ([texts, dimensions] float32) and how many tokens each text was."""

    vectors: np.ndarray
    token_counts: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(self.token_counts)

    def base64(self) -> list[str]:
        """Each vector as OpenAI's `encoding_format: base64` gives it: little-endian float32 bytes."""
        return [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in self.vectors]


def pool(hidden: np.ndarray, mask: np.ndarray, pooling: str) -> np.ndarray:
    """[rows, positions, hidden] states and their [rows, positions] mask (right-padded) to one
    vector per row: the last real position's state, or the mean of the real positions'."""
    lengths = mask.sum(axis=1)
    if pooling == "last":
        return hidden[np.arange(len(hidden)), lengths - 1]
    return (hidden * mask[:, :, None]).sum(axis=1) / lengths[:, None]


def normalized(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


class Embedder:
    """Runs an embedding export (see the module's text). `Engine.load` gives one for such an export."""

    def __init__(self, folder: Path, manifest: Manifest, options: RuntimeOptions, max_batch: int = 8, max_context: int | None = None):
        self.folder, self.manifest = Path(folder), manifest
        self.provider, self.provider_reason = choose_provider(options.provider)
        quantized = manifest.precision in ("int4", "int8")
        self.graph = Graph(self.folder / manifest.graph.file, self.provider, options.threads, quantized=quantized)
        self.graph.check_names(manifest.graph.inputs, manifest.graph.outputs)
        self.weights_kernel = self.graph.weights_kernel
        self.tokenizer = Tokenizer(self.folder, manifest.tokenizer)
        self.max_context = min(max_context or manifest.max_context, manifest.max_context)
        self.max_batch = max(1, max_batch)
        self.pooling, self.normalize = manifest.embedding["pooling"], manifest.embedding["normalize"]
        self.dimensions = manifest.embedding["dimensions"]
        self.matryoshka = list(manifest.embedding.get("matryoshka", []))
        self.mode = "embeddings, batches of up to %d texts" % self.max_batch
        self._busy, self._lock = 0, threading.Lock()

    def embed(
        self, texts: str | list, dimensions: int | None = None, truncate: bool = False, stop: threading.Event | None = None
    ) -> Embeddings:
        """Each text's embedding (a string, a list of strings, or token ids: a list of ints or a list
        of such lists). A text longer than the context is refused, or with `truncate` cut to its first
        `max_context` tokens. `dimensions` keeps the first N of a Matryoshka-trained model's dimensions
        (one of the widths it was trained for). Once `stop` is set (its caller went away), the next
        batch is not run: CancelledRequestError."""
        width = self._width(dimensions)
        ids = [self._ids(text, truncate) for text in _texts(texts)]
        with self._lock:
            self._busy += 1
        try:
            vectors = np.zeros((len(ids), self.dimensions), np.float32)
            order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
            for start in range(0, len(order), self.max_batch):
                if stop is not None and stop.is_set():
                    raise CancelledRequestError(f"embedding stopped after {start} of {len(ids)} inputs: its caller went away")
                rows = order[start : start + self.max_batch]
                vectors[rows] = self._run([ids[i] for i in rows])
        finally:
            with self._lock:
                self._busy -= 1
        vectors = vectors[:, :width]
        if self.normalize:
            vectors = normalized(vectors)
        return Embeddings(vectors, [len(i) for i in ids])

    def _run(self, batch: list[list[int]]) -> np.ndarray:
        width = max(len(ids) for ids in batch)
        input_ids = np.zeros((len(batch), width), np.int64)
        mask = np.zeros((len(batch), width), np.int64)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)], mask[row, : len(ids)] = ids, 1
        inputs = {
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": np.tile(np.arange(width, dtype=np.int64), (len(batch), 1)),
        }
        inputs = {name: value for name, value in inputs.items() if name in self.graph.inputs}
        _, outputs = self.graph.run(inputs, on_device=[], to_host=["last_hidden_state"])
        return pool(outputs["last_hidden_state"].astype(np.float32), mask, self.pooling)

    def _ids(self, text, truncate: bool) -> list[int]:
        if isinstance(text, str):
            ids = self.tokenizer.encode(text, True)
        else:
            ids = list(text)
            bad = [
                t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < self.manifest.vocab_size
            ]
            if bad:
                raise SettingsError(f"token id {bad[0]!r} is not in this model's vocabulary of {self.manifest.vocab_size}", "input")
        if not ids:
            raise SettingsError("an input to embed is empty: give each text at least one token", "input")
        if len(ids) > self.max_context:
            if not truncate:
                raise ContextLengthError(
                    f"an input has {len(ids)} tokens but the model's context is {self.max_context}: shorten it, or "
                    'pass truncate=True (the request\'s "truncate": true) to embed its first tokens',
                    len(ids),
                    self.max_context,
                )
            ids = ids[: self.max_context]
        return ids

    def _width(self, dimensions: int | None) -> int:
        if dimensions is None or dimensions == self.dimensions:
            return self.dimensions
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= self.dimensions:
            raise SettingsError(f"dimensions must be an integer from 1 to {self.dimensions}, got {dimensions!r}", "dimensions")
        if not self.matryoshka:
            raise SettingsError(
                f"this model's embeddings have {self.dimensions} dimensions and it is not Matryoshka-trained (its export names "
                "no --matryoshka dimensions), so a shorter vector would lose meaning: leave dimensions out",
                "dimensions",
            )
        if dimensions not in self.matryoshka:
            widths = ", ".join(str(w) for w in [*self.matryoshka, self.dimensions])
            raise SettingsError(
                f"dimensions {dimensions} is not a width this model was trained to give: use one of {widths}", "dimensions"
            )
        return dimensions

    # What a server and the model pool need of a loaded model (serve/backend.py's Backend).

    @property
    def is_idle(self) -> bool:
        with self._lock:
            return self._busy == 0

    def submit(self, prompt, **settings):
        raise SettingsError(NOT_GENERATING, "model")

    def generate(self, *args, **kwargs):
        raise SettingsError(NOT_GENERATING, "model")

    chat = stream = generate_batch = generate

    def stats(self) -> dict[str, float]:
        return {"running_rows": 0 if self.is_idle else 1}

    def close(self, grace: float | None = None) -> None:
        pass


def _texts(texts) -> list:
    """A string, a list of strings, a list of token ids, or a list of such lists, as a list of inputs."""
    if isinstance(texts, str):
        return [texts]
    if isinstance(texts, (list, tuple)) and texts and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in texts):
        return [list(texts)]
    if not isinstance(texts, (list, tuple)) or not texts:
        raise SettingsError("input must be a string, a non-empty list of strings, or token ids", "input")
    for text in texts:
        if not isinstance(text, (str, list, tuple)):
            raise SettingsError(f"each input must be a string or a list of token ids, got {type(text).__name__}", "input")
    return list(texts)
