"""The engine: load an export, then prefill once and decode one token at a time."""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import GenerationError, ManifestError
from .kv_cache import KVCache
from .manifest import Manifest, load_manifest
from .runtime import Graph, RuntimeOptions, choose_provider
from .sampling import greedy
from .tokenizer import Detokenizer, Tokenizer

DEFAULT_MAX_NEW_TOKENS = 256
# Inputs the engine knows how to fill, besides the KV cache.
_STEP_INPUTS = {"input_ids", "attention_mask", "position_ids"}


@dataclass
class Piece:
    """A piece of streamed output: whole characters of text and the tokens that made them.
    The last piece of a stream has `finish_reason` and the timings set."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    ttft_s: float | None = None
    decode_tokens_per_s: float | None = None
    prompt_tokens: int | None = None


@dataclass
class GenerationResult:
    """`token_ids` are the new tokens, without the EOS that ended generation;
    `finish_reason` is "eos" or "length"."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    ttft_s: float
    decode_tokens_per_s: float


class Engine:
    """Runs an edgeinfer export. Create it with `Engine.load(path)`."""

    def __init__(self, folder: Path, manifest: Manifest, options: RuntimeOptions):
        self.folder = Path(folder)
        self.manifest = manifest
        self.provider, self.provider_reason = choose_provider(options.provider)
        self.prefill_graph = self._open_graph(manifest.prefill, options)
        self.decode_graph = self._open_graph(manifest.decode, options)
        self.tokenizer = Tokenizer(self.folder, manifest.tokenizer)

    @classmethod
    def load(cls, path: str | Path, provider: str = "auto", threads: int | None = None) -> Engine:
        """Load an export folder made by `edgeinfer export`. `provider` is "auto" (CUDA where it
        can run, else CPU; `engine.provider_reason` says which and why), "cpu" or "cuda"."""
        options = RuntimeOptions(provider=provider, threads=threads)
        return cls(Path(path), load_manifest(path), options)

    def _open_graph(self, spec, options: RuntimeOptions) -> Graph:
        graph = Graph(self.folder / spec.file, self.provider, options.threads)
        graph.check_names(spec.inputs, spec.outputs)
        unknown = set(graph.inputs) - _STEP_INPUTS - set(self.manifest.kv.past)
        if unknown:
            raise ManifestError(f"{spec.file} takes inputs edgeinfer cannot fill: {sorted(unknown)}; export it with `edgeinfer export`")
        return graph

    def generate(self, prompt: str | list[int], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> GenerationResult:
        """Generate greedily after `prompt` (text, or token ids) and return the whole result."""
        pieces = list(self.stream(prompt, max_new_tokens))
        last = pieces[-1]
        return GenerationResult(
            text="".join(p.text for p in pieces),
            token_ids=[t for p in pieces for t in p.token_ids],
            prompt_tokens=last.prompt_tokens,
            finish_reason=last.finish_reason,
            ttft_s=last.ttft_s,
            decode_tokens_per_s=last.decode_tokens_per_s,
        )

    def stream(self, prompt: str | list[int], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> Iterator[Piece]:
        """Yield the output piece by piece as it is generated."""
        start = time.perf_counter()
        ids = self.prompt_ids(prompt)
        budget = self._token_budget(len(ids), max_new_tokens)
        detokenizer = Detokenizer(self.tokenizer)
        times, pending, finish, made = [], [], "length", 0
        tokens = self._token_stream(ids)
        for token in tokens:
            times.append(time.perf_counter())
            if token in self.manifest.eos_token_ids:
                finish = "eos"
                break
            made += 1
            pending.append(token)
            text = detokenizer.add(token)
            if text:
                yield Piece(text, pending)
                pending = []
            if made == budget:
                break
        tokens.close()
        yield Piece(detokenizer.flush(), pending, finish, times[0] - start, _rate(times), len(ids))

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template, ready for a reply."""
        return self.tokenizer.encode(self.tokenizer.render_chat(messages), add_special_tokens=False)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.manifest.vocab_size]
            if bad:
                raise GenerationError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.manifest.vocab_size - 1})")
        if not ids:
            raise GenerationError("the prompt is empty: pass some text or token ids")
        return ids

    def _token_budget(self, prompt_len: int, max_new_tokens: int) -> int:
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        room = self.manifest.max_context - prompt_len
        if room < 1:
            raise GenerationError(
                f"the prompt has {prompt_len} tokens but the model's context is {self.manifest.max_context}: shorten the prompt"
            )
        return min(max_new_tokens, room)

    def _token_stream(self, ids: list[int]) -> Iterator[int]:
        """Prefill, then decode → sample forever; the caller stops it."""
        cache = KVCache(self.manifest.kv)
        logits = self.prefill(ids, cache)
        while True:
            token = greedy(logits)
            yield token
            logits = self.decode(token, cache)

    def prefill(self, ids: list[int], cache: KVCache) -> np.ndarray:
        """Run the prefill graph over the whole prompt; fills `cache`, returns the logits."""
        n = len(ids)
        step = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, n), np.int64),
                "position_ids": np.arange(n, dtype=np.int64)[None, :]}
        return self._run(self.prefill_graph, step, cache)

    def decode(self, token: int, cache: KVCache) -> np.ndarray:
        """Run the decode graph for one new token on top of `cache`; returns its logits."""
        n = cache.length
        step = {"input_ids": np.array([[token]], np.int64), "attention_mask": np.ones((1, n + 1), np.int64),
                "position_ids": np.array([[n]], np.int64)}
        return self._run(self.decode_graph, step, cache)

    def _run(self, graph: Graph, step: dict, cache: KVCache) -> np.ndarray:
        """One pass of a graph: the step's inputs it takes plus the cache's past (empty before
        prefill); the presents stay on the device in the cache, only the logits come to the host."""
        inputs = {name: value for name, value in step.items() if name in graph.inputs}
        present, host = graph.run({**inputs, **cache.past}, keep=cache.present_names, fetch=["logits"])
        cache.update(present)
        return host["logits"]


def _rate(times: list[float]) -> float:
    """Tokens per second after the first token."""
    if len(times) < 2 or times[-1] <= times[0]:
        return 0.0
    return (len(times) - 1) / (times[-1] - times[0])
