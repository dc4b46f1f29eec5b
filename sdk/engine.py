"""The engine: load an export, then prefill once and decode one token at a time."""
from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .constraints import Constraints
from .errors import ContextLengthError, GenerationError, ManifestError, SettingsError
from .kv_cache import PAD_ID, InPlaceKVCache, KVCache, PrefixCache
from .manifest import Manifest, load_manifest, verify_files
from .memory import LoadLimits, MemoryPlan, available_bytes, check_generation
from .runtime import Graph, GenerationBindings, LogitsHeads, RowCopy, RuntimeOptions, choose_provider, load_weights
from .sequence import GenerationResult, Piece, Sequence
from .settings import GenerationConfig, resolve_settings
from .speculative import DraftModel, PromptLookup, Speculation
from .tokenizer import Tokenizer

# Prefilling in chunks gives bit-identical logits with a smaller memory peak (README, "Chunked
# prefill", has the figures measured on SmolLM2).
DEFAULT_PREFILL_CHUNK = 256
# MiB of prompts' keys and values kept for prompts that start the same way (SmolLM2: 46 KiB a
# token, so about 1,400 tokens).
DEFAULT_PREFIX_CACHE_MIB = 64
# Inputs the engine knows how to fill, besides the KV cache.
_STEP_INPUTS = {"input_ids", "attention_mask", "position_ids", "logits_to_keep"}

Prompt = str | list[int]


class Engine:
    """Runs an edgeinfer export. Create it with `Engine.load(path)`.

    An engine keeps no state between calls (each generation has its own KV cache), so one
    engine can serve several threads at once."""

    def __init__(self, folder: Path, manifest: Manifest, options: RuntimeOptions, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 limits: LoadLimits = LoadLimits()):
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise SettingsError(f"prefill_chunk must be an integer of at least 1, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        self.folder = Path(folder)
        self.manifest = manifest
        self.max_context = _serving_context(manifest, limits.max_context)
        self.default_config = _model_defaults(manifest)
        self.provider, self.provider_reason = choose_provider(options.provider)
        available = available_bytes(self.provider, limits.memory_limit)
        # Each session of the split layout keeps its own copy of the weights on the CPU.
        weight_copies = 2 if manifest.prefill is not None and self.provider == "cpu" else 1
        plan = MemoryPlan.of(manifest, self.max_context, limits.max_batch, weight_copies)
        self.memory = dataclasses.replace(plan, prefix_cache=_prefix_budget(limits.prefix_cache, plan, available[0], limits.memory_limit))
        self._memory_limit = limits.memory_limit
        self.memory.check(*available)  # before the weights are read
        # The split layout (export --graphs split): a prefill graph for the first chunk of a prompt,
        # on an empty past; everything else runs on `graph`, its decode graph. On a GPU both
        # sessions use one copy of the weights, loaded once on the device; on the CPU each session
        # keeps its own (pre-packed) copy, the smallest of the options measured (README, "Split graphs").
        shared = None
        if manifest.prefill is not None and self.provider != "cpu":
            shared = load_weights(self.folder / manifest.graph.file, self.provider)
        self.graph = self._open_graph(manifest.graph, options, shared)
        self.prefill_graph = self._open_graph(manifest.prefill, options, shared) if manifest.prefill is not None else None
        self._shared_weights = shared  # the sessions use these values: they live as long as the engine
        self.static = manifest.static_context is not None  # the decode graph's shapes are fixed
        self.heads = LogitsHeads(self.graph.output_types["logits"], self.provider)
        self.tokenizer = Tokenizer(self.folder, manifest.tokenizer)
        # Prompts' keys and values kept for the next prompt that starts the same way, on the host
        # (kv_cache.PrefixCache): read and written through host views of the buffers on the CPU
        # provider, copied (runtime.RowCopy) elsewhere.
        usable = manifest.kv.sequence_axis == 2 and not self.static  # its prompts' tails would go one token a pass
        self.prefix_cache = PrefixCache(self.memory.prefix_cache if usable else 0)
        # Where the cache's buffers have no host view, the prefix cache copies a row's cached tokens.
        copies = manifest.kv.in_place and self.provider != "cpu" and manifest.kv.dtype in ("float32", "float16")
        self.row_copy = RowCopy(manifest.kv.dtype, self.provider) if copies else None
        eos = manifest.eos_token_ids or tuple(t for t in [self.tokenizer.token_id(manifest.tokenizer.eos_token)] if t is not None)
        self.constraints = Constraints(self.tokenizer, manifest.vocab_size, eos)
        self.draft: Engine | None = None

    @classmethod
    def load(cls, path: str | Path, provider: str = "auto", threads: int | None = None,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, max_context: int | None = None, max_batch: int = 1,
             memory_limit: int | None = None, verify: bool = False, prefix_cache: int | None = None,
             draft: str | Path | None = None) -> Engine:
        """Load an export folder made by `edgeinfer export`. `provider` is "auto" (CUDA where it
        can run, else CPU; `engine.provider_reason` says which and why), "cpu" or "cuda".
        Prompts are prefilled `prefill_chunk` tokens at a time (same results, a smaller memory peak).

        The engine serves prompts and replies of up to `max_context` tokens (default: the
        export's) in batches of `max_batch`; loading refuses, before reading the weights, where
        they and that much KV cache do not fit in `memory_limit` bytes (default: the memory the
        device has free). File sizes are always checked against the manifest; `verify` checks
        their SHA-256 too (it reads every byte).

        `prefix_cache` MiB of prompts' keys and values are kept (default: 64, or what fits beside
        the weights and KV cache; none under a `memory_limit`), so a prompt that starts like a recent one (a system prompt, a
        document, a conversation's earlier turns) prefills only the rest, with the same logits; 0
        turns it off. It serves single prompts, batches and the Scheduler's rows.

        `draft` is the export folder of a smaller model with the same tokenizer, loaded beside
        this one, for `speculative="draft"` (speculative.py)."""
        options = RuntimeOptions(provider=provider, threads=threads)
        if prefix_cache is not None and (isinstance(prefix_cache, bool) or not isinstance(prefix_cache, int) or prefix_cache < 0):
            raise SettingsError(f"prefix_cache must be a number of MiB of at least 0 (0 turns it off), got {prefix_cache!r}")
        limits = LoadLimits(max_context, max_batch, memory_limit, None if prefix_cache is None else prefix_cache * 2**20)
        manifest = load_manifest(path)
        if verify:
            verify_files(Path(path), manifest.files)
        engine = cls(Path(path), manifest, options, prefill_chunk, limits)
        if draft is not None:
            context = load_manifest(draft).max_context
            if context < engine.max_context:
                raise SettingsError(f"the draft model {draft} serves {context} tokens, fewer than this engine's {engine.max_context}: "
                                    f"load the engine with max_context={context} (--max-context {context}), or export the draft "
                                    "with a larger --max-context")
            engine.attach_draft(cls.load(draft, provider=engine.provider, threads=threads, max_context=engine.max_context,
                                         max_batch=max_batch, verify=verify, prefix_cache=0))
        return engine

    def speculate_by_default(self, mode: str | None) -> None:
        """Make `mode` ("prompt_lookup" or "draft") the speculative decoding of calls that do not
        set theirs (a server's default); raises now where this engine cannot."""
        config = dataclasses.replace(self.default_config, speculative=mode)
        self._speculation(config, 1, self.max_context)
        self.default_config = config

    def attach_draft(self, draft: Engine) -> None:
        """Use `draft` (an engine of a smaller model with the same tokenizer) to propose tokens
        for `speculative="draft"`. Refused where its vocabulary differs from this model's."""
        if draft.manifest.vocab_size != self.manifest.vocab_size or draft.tokenizer.vocabulary.tokens != self.tokenizer.vocabulary.tokens:
            raise ManifestError(f"the draft model {draft.folder} has another vocabulary ({draft.manifest.vocab_size} ids against "
                                f"{self.manifest.vocab_size}, or other tokens): a draft must use this model's tokenizer")
        self.draft = draft

    def _open_graph(self, spec, options: RuntimeOptions, shared: dict | None = None) -> Graph:
        graph = Graph(self.folder / spec.file, self.provider, options.threads, shared)
        graph.check_names(spec.inputs, spec.outputs)
        unknown = set(graph.inputs) - _STEP_INPUTS - set(self.manifest.kv.past)
        if unknown:
            raise ManifestError(f"{spec.file} takes inputs edgeinfer cannot fill: {sorted(unknown)}; export it with `edgeinfer export`")
        return graph

    # The public calls. Settings: `config=` (a GenerationConfig; default: the model's own) and/or
    # any of its fields as keywords, e.g. `generate(prompt, temperature=0.7, seed=1)`.

    def generate(self, prompt: Prompt, config: GenerationConfig | None = None, **settings) -> GenerationResult:
        """Generate after `prompt` (text, or token ids) and return the whole result."""
        if _is_batch(prompt):
            warnings.warn("generate() with a list of prompts is deprecated and will take one prompt only in the next "
                          "release: call generate_batch(prompts) for a batch", DeprecationWarning, stacklevel=2)
            return self.generate_batch(prompt, config, **settings)
        return GenerationResult.from_pieces(list(self.stream(prompt, config, **settings)))

    def generate_batch(self, prompts: list[Prompt], config: GenerationConfig | list[GenerationConfig] | None = None,
                       **settings) -> list[GenerationResult]:
        """Run `prompts` as one batch and return one result per prompt, in their order. `config` is
        one GenerationConfig for every row, or a list of one per prompt (each row its own sampling,
        constraint, stop conditions and max_new_tokens); keywords apply to every row."""
        rows = [[] for _ in range(len(prompts) if isinstance(prompts, (list, tuple)) else 0)]
        for row, piece in self.stream_batch(prompts, config, **settings):
            rows[row].append(piece)
        return [GenerationResult.from_pieces(pieces) for pieces in rows]

    def stream(self, prompt: Prompt, config: GenerationConfig | None = None, **settings) -> Iterator[Piece]:
        """Yield the output piece by piece as it is generated. Closing the iterator stops the work."""
        if _is_batch(prompt):
            raise GenerationError("stream takes one prompt: use stream_batch (or generate_batch) for a list of prompts")
        return _only_pieces(self._start([prompt], config, settings))

    def stream_batch(self, prompts: list[Prompt], config: GenerationConfig | list[GenerationConfig] | None = None,
                     **settings) -> Iterator[tuple[int, Piece]]:
        """Run `prompts` as one batch, yielding (row, piece) as each row's output is generated."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise GenerationError("stream_batch takes a non-empty list of prompts")
        return self._start(list(prompts), config, settings)

    def chat(self, messages: list[dict], config: GenerationConfig | None = None, **settings) -> GenerationResult:
        """The model's reply to a conversation (a list of {"role", "content"} messages)."""
        return self.generate(self.chat_prompt(messages), config, **settings)

    def stream_chat(self, messages: list[dict], config: GenerationConfig | None = None, **settings) -> Iterator[Piece]:
        """The model's reply to a conversation, piece by piece."""
        return self.stream(self.chat_prompt(messages), config, **settings)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template, ready for a reply."""
        return self.tokenizer.chat_ids(messages, self.max_context)

    def prompt_ids(self, prompt: Prompt, within_context: bool = True) -> list[int]:
        """The prompt's token ids; text that cannot leave room in the context is refused before
        it is encoded, unless `within_context` is False (a prompt to truncate)."""
        return self.tokenizer.prompt_ids(prompt, self.manifest.vocab_size, self.max_context if within_context else None)

    # Generation.

    def _start(self, prompts: list[Prompt], config: GenerationConfig | None, settings: dict) -> Iterator[tuple[int, Piece]]:
        """Check everything, then hand back the generation loop (which does the work as it is iterated)."""
        return self._generate(*self._sequences(prompts, config, settings))

    def _generate(self, rows: list[Sequence], is_greedy: bool) -> Iterator[tuple[int, Piece]]:
        """The generation loop for rows already checked, once their KV cache is known to fit."""
        capacity = max(len(row.prompt_ids) + row.budget for row in rows)
        check_generation(self.memory, len(rows), capacity, self.provider, self._memory_limit)
        if any(row.speculation for row in rows):
            return self._speculative_loop(rows, is_greedy, capacity)
        return self._loop(rows, is_greedy, capacity)

    def _sequences(self, prompts: list[Prompt], config, settings: dict) -> tuple[list[Sequence], bool]:
        """Each prompt's Sequence (its token budget, stop conditions, sampler and constraint), and
        whether every row is greedy; raises, before any work, on bad settings or prompts. `config`
        is one GenerationConfig for every row, or a list of one per prompt. In a batch the longest
        prompt sets the room left in the context for every row."""
        start = time.perf_counter()
        configs = config if isinstance(config, (list, tuple)) else [config] * len(prompts)
        if len(configs) != len(prompts):
            raise SettingsError(f"{len(configs)} configs for {len(prompts)} prompts: pass one config, or one per prompt")
        configs = [resolve_settings(self.default_config, c, settings) for c in configs]
        for c in configs:
            self._check_token_ids(c)
        given = [self.prompt_ids(p, c.truncate != "left") for p, c in zip(prompts, configs)]
        ids = [self._truncate(row, c) for row, c in zip(given, configs)]
        room = self._room(ids)
        rows = [Sequence(row, c, min(c.max_new_tokens, room), self.manifest.eos_token_ids, self.tokenizer, start,
                         len(full) - len(row), self.constraints.start(c.constraint))
                for row, full, c in zip(ids, given, configs)]
        for row, c in zip(rows, configs):
            row.speculation = self._speculation(c, len(rows), len(row.prompt_ids) + row.budget)
        return rows, all(c.is_greedy for c in configs)

    def _speculation(self, config: GenerationConfig, batch: int, capacity: int) -> Speculation | None:
        """A row's speculative decoding as its settings ask, or None; raises where this engine cannot."""
        if config.speculative is None:
            return None
        if "logits_to_keep" not in self.graph.inputs:
            raise SettingsError("this export gives the logits of the last position only, and speculative decoding checks "
                                f"several: export the model again with this edgeinfer (`edgeinfer export MODEL -o {self.folder} "
                                "--force`)")
        if batch > 1 and not self.manifest.kv.in_place:
            raise SettingsError("this export keeps optimum-onnx's attention, whose cache serves speculative decoding for one "
                                "prompt at a time: generate the prompts one by one")
        if config.speculative == "draft" and self.draft is None:
            raise SettingsError("speculative='draft' needs a draft model: load the engine with Engine.load(path, draft=DRAFT_DIR) "
                                "(--draft DIR), or use speculative='prompt_lookup'")
        proposer = DraftModel(self.draft, capacity) if config.speculative == "draft" else PromptLookup()
        return Speculation(proposer, config.num_speculative_tokens)

    def _truncate(self, ids: list[int], config: GenerationConfig) -> list[int]:
        """With `truncate="left"`, the end of a prompt that leaves too little room for
        `max_new_tokens` (at least one prompt token is kept)."""
        if config.truncate != "left":
            return ids
        return ids[-max(1, self.max_context - config.max_new_tokens):]

    def _loop(self, rows: list[Sequence], is_greedy: bool, capacity: int) -> Iterator[tuple[int, Piece]]:
        """Prefill once, then choose → yield → decode until every row has ended."""
        cache, kept = self.new_cache(capacity), GenerationBindings()
        logits = self._prefill([row.prompt_ids for row in rows], cache, kept)
        for row, cached in zip(rows, cache.cached):
            row.cached = cached
        while True:
            tokens = self._choose(logits, rows, is_greedy, kept)
            for index, (row, token) in enumerate(zip(rows, tokens)):
                piece = None if row.is_done else row.add(token)
                if piece is not None:
                    yield index, piece
            if all(row.is_done for row in rows):
                return
            logits = self._run(cache.decode_inputs([PAD_ID if row.is_done else t for row, t in zip(rows, tokens)]), cache, kept)

    def _speculative_loop(self, rows: list[Sequence], is_greedy: bool, capacity: int) -> Iterator[tuple[int, Piece]]:
        """Prefill once, choose each row's first token; then, row by row, propose → check in one
        pass → keep what the model agrees with, until every row has ended."""
        cache, kept = self.new_cache(capacity), GenerationBindings()
        logits = self._prefill([row.prompt_ids for row in rows], cache, kept)
        for row, cached in zip(rows, cache.cached):
            row.cached = cached
        for index, (row, token) in enumerate(zip(rows, self._choose(logits, rows, is_greedy, kept))):
            piece = row.add(token)
            if piece is not None:
                yield index, piece
        while not all(row.is_done for row in rows):
            for index, row in enumerate(rows):
                if not row.is_done:
                    yield from ((index, piece) for piece in self.speculate(index, row, cache, kept))

    def speculate(self, index: int, row: Sequence, cache: KVCache, kept: GenerationBindings) -> Iterator[Piece]:
        """One step of one row: its newest token (not yet in the cache) and the proposed ones run
        in one pass; each position's choice is taken while it equals the proposal, and the first
        that differs (or the one after the last proposal) is the step's last. The cache then
        forgets the rejected proposals."""
        speculation = row.speculation
        proposal = speculation.propose(row.history, row.budget - row.made - 1) if speculation else []
        logits = self.extend([row.history[-1], *proposal], cache, index, kept)
        greedy = self.heads.tokens(logits)[0] if row.is_plain_greedy else None
        every = None if row.is_plain_greedy else self.heads.every(logits)[0]
        accepted = 0
        for i in range(len(proposal) + 1):
            guess = proposal[i] if i < len(proposal) else None
            token = int(greedy[i]) if greedy is not None else row.choose(every[i], guess)
            if token == guess:
                accepted += 1
                speculation.accepted += 1  # before `add`, whose last piece carries the counts
            piece = row.add(token)
            if piece is not None:
                yield piece
            if row.is_done or token != guess:
                break
        if speculation:
            speculation.record(len(proposal), accepted)
        cache.drop(index, len(proposal) - accepted)

    def _choose(self, logits: ort.OrtValue, rows: list[Sequence], is_greedy: bool, kept: GenerationBindings) -> list[int]:
        """The next token of every row. Greedy needs only the ids, so ArgMax runs on the device
        that holds the logits; sampling brings each row's last-position logits to the host."""
        if is_greedy:
            return self.heads.argmax(logits, kept)
        last = self.heads.last(logits)
        return [PAD_ID if row.is_done else row.choose(last[i]) for i, row in enumerate(rows)]

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """An empty KV cache for one generation of at most `capacity` tokens per row, prompt
        included (default: the engine's context). Only a graph that writes its cache in place
        (`kv.in_place`) allocates it, once, at the first prefill."""
        shapes = {name: self.graph.inputs[name].shape for name in self.manifest.kv.past}
        if self.static:  # the decode graph takes buffers of exactly this capacity
            capacity = self.manifest.static_context
        if self.manifest.kv.in_place:
            return InPlaceKVCache(self.manifest.kv, shapes, capacity or self.max_context, self.graph.allocate,
                                  self.prefix_cache, self.graph, self.row_copy, self.static)
        return KVCache(self.manifest.kv, shapes, self.prefix_cache, self.graph)

    def prefill(self, prompts: list[list[int]], cache: KVCache) -> ort.OrtValue:
        """Run the graph over the prompts (one batch), `prefill_chunk` positions at a time, the
        first chunk on an empty past; fills `cache` and returns the last position's logits
        [batch, 1, vocab], left on the device. Each call returns a new logits value."""
        return self._prefill(prompts, cache, None)

    def decode(self, tokens: list[int], cache: KVCache) -> ort.OrtValue:
        """Run the graph for one new token per row on top of `cache`; returns the logits
        [batch, 1, vocab], left on the device. Each call returns a new logits value."""
        return self._run(cache.decode_inputs(tokens), cache, None)

    def extend(self, tokens: list[int], cache: KVCache, row: int = 0, kept: GenerationBindings | None = None,
               keep: int | None = None) -> ort.OrtValue:
        """Run the graph for several new tokens of one row on top of `cache`; returns the logits of
        each (of the last `keep`, where given), [1, positions, vocab], left on the device
        (speculative decoding checks proposed tokens so). With `kept`, the row's binding is kept
        there for the next call."""
        if "logits_to_keep" not in self.graph.inputs:
            raise GenerationError("this export gives the logits of the last position only: export the model again with this "
                                  "edgeinfer (`edgeinfer export`)")
        if self.static and len(tokens) > 1:  # a decode graph of fixed shapes takes one token a pass
            logits = np.concatenate([self.extend([token], cache, row, None).numpy() for token in tokens][-(keep or len(tokens)):], axis=1)
            value = ort.OrtValue.ortvalue_from_shape_and_type(logits.shape, logits.dtype, "cpu", 0)  # owns its memory
            value.update_inplace(logits)  # (ortvalue_from_numpy would point into the array, freed on return)
            return value
        inputs = cache.extend_inputs(row, tokens, keep)
        if not self.manifest.kv.in_place:
            return self._run(inputs, cache, None)
        return self._run_row(inputs, cache, row, kept)

    def _run_row(self, inputs: dict, cache: KVCache, row: int, kept: GenerationBindings | None) -> ort.OrtValue:
        """One pass on one row of a cache written in place, bound alone (kept in `kept.rows`)."""
        binding = kept.rows.get(row) if kept is not None else None
        if binding is None:
            binding = self.graph.bind_rows(cache.pooled, row, 1)
            if kept is not None:
                kept.rows[row] = binding
        binding.run(inputs, fresh=("logits",))
        return binding.outputs()[-1]

    def _prefill(self, prompts: list[list[int]], cache: KVCache, kept: GenerationBindings | None) -> ort.OrtValue:
        if cache.prefills_by_row(prompts):  # a batch with rows in the prefix cache
            for row, chunk in cache.prefill_rows(prompts, self.prefill_chunk):
                logits = self._run(chunk, cache, kept) if row is None else self._run_row(chunk, cache, row, kept)
            return logits
        if self.prefill_graph is None:
            for chunk in cache.prefill_chunks(prompts, self.prefill_chunk):
                logits = self._run(chunk, cache, kept)
            return logits
        # The split layout: the prefill graph reads the first chunk (its fixed length, where it has
        # one); the rest of a longer prompt goes through the decode graph, one token a pass where
        # its shapes are fixed.
        chunk = 1 if self.static else self.prefill_chunk
        for inputs in cache.prefill_chunks(prompts, chunk, self.manifest.prefill_length):
            logits = self._run_prefill_graph(inputs, cache) if cache.empty_past else self._run(inputs, cache, kept)
        return logits

    def _run_prefill_graph(self, inputs: dict, cache: KVCache) -> ort.OrtValue:
        """One pass of the split layout's prefill graph (no past); its presents fill the cache."""
        graph = self.prefill_graph
        outputs, _ = graph.run({name: value for name, value in inputs.items() if name in graph.inputs},
                               keep=[*self.manifest.kv.present, "logits"], fetch=[])
        cache.fill(outputs)
        return outputs["logits"]

    def _run(self, inputs: dict, cache: KVCache, kept: GenerationBindings | None) -> ort.OrtValue:
        """One pass of the graph: the inputs it takes plus the cache's past; the presents and the
        logits stay on the device. With `kept` (the generation loop's), a cache written in place
        stays bound with one logits value from pass to pass, which each pass overwrites."""
        inputs = {name: value for name, value in inputs.items() if name in self.graph.inputs}
        if kept is not None and kept.graph is not None:  # two binds and a run
            kept.graph.run(inputs)
            return kept.logits
        outputs, _ = self.graph.run({**inputs, **cache.past}, keep=[*cache.keep, "logits"], fetch=[], into=cache.into)
        cache.update(outputs)
        if kept is not None and cache.into:
            kept.logits = outputs["logits"]
            kept.graph = self.graph.bind(cache.past, {**cache.into, "logits": kept.logits})
        return outputs["logits"]

    def _check_token_ids(self, config: GenerationConfig) -> None:
        for name, ids in (("stop_token_ids", config.stop_token_ids), ("logit_bias", [t for t, _ in config.logit_bias])):
            bad = [t for t in ids if t >= self.manifest.vocab_size]
            if bad:
                raise SettingsError(f"{name} {bad[:5]} are outside the vocabulary (0..{self.manifest.vocab_size - 1})")

    def _room(self, prompts: list[list[int]]) -> int:
        """New tokens each row may make before the context ends. In a batch the longest prompt
        sets the room left for every row."""
        longest = max(len(p) for p in prompts)
        room = self.max_context - longest
        if room < 1:
            which = "the prompt has" if len(prompts) == 1 else "the longest prompt of the batch has"
            context = "model's" if self.max_context == self.manifest.max_context else "engine's (max_context)"
            raise ContextLengthError(f"{which} {longest} tokens but the {context} context is {self.max_context}: shorten the "
                                     "prompt, or pass truncate='left' (--truncate left) to keep its end", longest, self.max_context)
        return room


def _prefix_budget(asked: int | None, plan: MemoryPlan, available: int | None, memory_limit: int | None) -> int:
    """Bytes for the prefix cache: as asked (the memory check then counts it). By default none
    under a memory limit (an app that sets one asks for the cache too), else up to
    DEFAULT_PREFIX_CACHE_MIB, within what the device has beside the weights and KV cache."""
    if asked is not None:
        return asked
    if memory_limit is not None:
        return 0
    default = DEFAULT_PREFIX_CACHE_MIB * 2**20
    return default if available is None else max(0, min(default, available - plan.total))


def _serving_context(manifest: Manifest, requested: int | None) -> int:
    if requested is not None and requested > manifest.max_context:
        raise SettingsError(f"max_context {requested} is more than the export's context of {manifest.max_context} tokens: "
                            f"pass at most {manifest.max_context}")
    return requested or manifest.max_context


def _model_defaults(manifest: Manifest) -> GenerationConfig:
    try:
        return GenerationConfig(**manifest.generation)
    except (SettingsError, TypeError) as e:
        raise ManifestError(f"the manifest's generation defaults are invalid ({e}): export the model again") from None


def _is_batch(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(p, (str, list, tuple)) for p in prompt)


def _only_pieces(events: Iterator[tuple[int, Piece]]) -> Iterator[Piece]:
    try:
        for _, piece in events:
            yield piece
    finally:
        events.close()
