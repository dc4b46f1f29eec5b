"""The engine: load an export, then prefill once and decode one token at a time."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from pathlib import Path

from .constraints import Constraints
from .embedder import Embedder
from .errors import GenerationError, ManifestError, SettingsError
from .generation import generate
from .manifest import Manifest, export_folder, load_manifest, verify_files
from .memory import LoadLimits, MemoryPlan, available_bytes, check_generation
from .prepare import prepare, speculation
from .runner import ModelRunner
from .runtime import RuntimeOptions, choose_provider
from .sequence import GenerationResult, Piece, Sequence
from .settings import GenerationConfig
from .tokenizer import Tokenizer, template_variables
from .chat import chat_turn
from .chat_stream import ChatDelta, chat_deltas
from .tools import tool_request

DEFAULT_PREFILL_CHUNK = 256  # prompt tokens a prefill pass takes: the same logits, a smaller peak
DEFAULT_PREFIX_CACHE_MIB = 64  # prompts' keys and values kept for prompts that start the same way

Prompt = str | list[int]


class Engine:
    """Runs an edgeinfer export. Create it with `Engine.load(path)`.

    An engine keeps no state between calls (each generation has its own KV cache), so one
    engine can serve several threads at once."""

    def __init__(
        self,
        folder: Path,
        manifest: Manifest,
        options: RuntimeOptions,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        limits: LoadLimits = LoadLimits(),
    ):
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise SettingsError(f"prefill_chunk must be an integer of at least 1, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        self.folder = Path(folder)
        self.manifest = manifest
        self.max_context = serving_context(manifest, limits.max_context)
        self.default_config = _model_defaults(manifest)
        self.provider, self.provider_reason = choose_provider(options.provider)
        available = available_bytes(self.provider, limits.memory_limit)
        # Each session of the split layout keeps its own copy of the weights on the CPU.
        weight_copies = 2 if manifest.prefill is not None and self.provider == "cpu" else 1
        plan = MemoryPlan.of(manifest, self.max_context, limits.max_batch, weight_copies)
        self.memory = dataclasses.replace(
            plan, prefix_cache=_prefix_budget(limits.prefix_cache, plan, available[0], limits.memory_limit)
        )
        self.memory_limit = limits.memory_limit
        self.memory.check(*available)  # before the weights are read
        self.tokenizer = Tokenizer(self.folder, manifest.tokenizer)
        self.runner = ModelRunner(
            self.folder, manifest, self.provider, options, self.max_context, prefill_chunk, self.memory.prefix_cache
        )
        self.prefix_cache = self.runner.prefix_cache
        self.weights_kernel = self.runner.base_graph.weights_kernel  # what runs the quantized weights here, and why
        eos = manifest.eos_token_ids or tuple(t for t in [self.tokenizer.token_id(manifest.tokenizer.eos_token)] if t is not None)
        self.constraints = Constraints(self.tokenizer, manifest.vocab_size, eos)
        self.draft: Engine | None = None

    @classmethod
    def load(
        cls,
        path: str | Path,
        provider: str = "auto",
        threads: int | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        max_context: int | None = None,
        max_batch: int = 1,
        memory_limit: int | None = None,
        verify: bool = False,
        prefix_cache: int | None = None,
        draft: str | Path | None = None,
        chat_template: str | None = None,
    ) -> Engine | Embedder:
        """Load an export folder made by `edgeinfer export`, or a catalog model's export by its name
        (an embedding export gives an Embedder). `provider` is "auto" (CUDA where it
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
        this one, for `speculative="draft"` (speculative.py). `chat_template` (Jinja text) renders
        conversations in place of the export's template, or gives one to an export without."""
        options = RuntimeOptions(provider=provider, threads=threads)
        if prefix_cache is not None and (isinstance(prefix_cache, bool) or not isinstance(prefix_cache, int) or prefix_cache < 0):
            raise SettingsError(f"prefix_cache must be a number of MiB of at least 0 (0 turns it off), got {prefix_cache!r}")
        limits = LoadLimits(max_context, max_batch, memory_limit, None if prefix_cache is None else prefix_cache * 2**20)
        path = export_folder(path)
        manifest = load_manifest(path)
        if verify:
            verify_files(path, manifest.files)
        if manifest.task == "embedding":  # an embedding model: Embedder's embed() in place of generation
            return Embedder(Path(path), manifest, options, max_batch if max_batch > 1 else 8, max_context)
        engine = cls(Path(path), manifest, options, prefill_chunk, limits)
        if chat_template is not None:
            engine.tokenizer.use_template(chat_template)
        if draft is not None:
            engine._load_draft(draft, threads, max_batch, verify)
        return engine

    def _load_draft(self, draft: str | Path, threads: int | None, max_batch: int, verify: bool) -> None:
        """The draft model for speculative="draft", loaded beside this one on its provider and context."""
        context = load_manifest(draft).max_context
        if context < self.max_context:
            raise SettingsError(
                f"the draft model {draft} serves {context} tokens, fewer than this engine's {self.max_context}: "
                f"load the engine with max_context={context}, or export the draft with a larger max_context"
            )
        self.attach_draft(
            Engine.load(
                draft,
                provider=self.provider,
                threads=threads,
                max_context=self.max_context,
                max_batch=max_batch,
                verify=verify,
                prefix_cache=0,
            )
        )

    def speculate_by_default(self, mode: str | None) -> None:
        """Make `mode` ("prompt_lookup" or "draft") the speculative decoding of calls that do not
        set theirs (a server's default); raises now where this engine cannot."""
        config = dataclasses.replace(self.default_config, speculative=mode)
        speculation(self, config, 1, self.max_context)
        self.default_config = config

    def attach_draft(self, draft: Engine) -> None:
        """Use `draft` (an engine of a smaller model with the same tokenizer) to propose tokens
        for `speculative="draft"`. Refused where its vocabulary differs from this model's, or where
        it keeps a recurrent state."""
        if (
            draft.manifest.vocab_size != self.manifest.vocab_size
            or draft.tokenizer.vocabulary.tokens != self.tokenizer.vocabulary.tokens
        ):
            raise ManifestError(
                f"the draft model {draft.folder} has another vocabulary ({draft.manifest.vocab_size} ids against "
                f"{self.manifest.vocab_size}, or other tokens): a draft must use this model's tokenizer"
            )
        if not all(kind.forgets for kind in draft.runner.kinds):
            raise ManifestError(
                f"the draft model {draft.folder} keeps a recurrent state (linear attention), which cannot take back the "
                "guesses the model rejects: use a draft of attention layers only, or speculative='prompt_lookup'"
            )
        self.draft = draft

    # The public calls. Settings: `config=` (a GenerationConfig; default: the model's own) and/or
    # any of its fields as keywords, e.g. `generate(prompt, temperature=0.7, seed=1)`.

    def generate(self, prompt: Prompt, config: GenerationConfig | None = None, **settings) -> GenerationResult:
        """Generate after `prompt` (text, or token ids) and return the whole result."""
        if _is_batch(prompt):
            warnings.warn(
                "generate() with a list of prompts is deprecated and will take one prompt only in the next "
                "release: call generate_batch(prompts) for a batch",
                DeprecationWarning,
                stacklevel=2,
            )
            return self.generate_batch(prompt, config, **settings)
        return GenerationResult.from_pieces(list(self.stream(prompt, config, **settings)))

    def generate_batch(
        self, prompts: list[Prompt], config: GenerationConfig | list[GenerationConfig] | None = None, **settings
    ) -> list[GenerationResult]:
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

    def stream_batch(
        self, prompts: list[Prompt], config: GenerationConfig | list[GenerationConfig] | None = None, **settings
    ) -> Iterator[tuple[int, Piece]]:
        """Run `prompts` as one batch, yielding (row, piece) as each row's output is generated."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise GenerationError("stream_batch takes a non-empty list of prompts")
        return self._start(list(prompts), config, settings)

    def chat(
        self,
        messages: list[dict],
        config: GenerationConfig | None = None,
        *,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = False,
        chat_template_kwargs: dict | None = None,
        **settings,
    ) -> GenerationResult:
        """The model's reply to a conversation (a list of {"role", "content"} messages). With
        `tools` (OpenAI's function tools), the calls it makes are in `result.tool_calls`;
        `tool_choice` "required" or a named tool constrains the output to valid calls (tools.py).
        A reasoning model's thinking is in `result.reasoning` (reasoning.py); `chat_template_kwargs`
        are the template's own variables (`{"enable_thinking": False}`)."""
        *_, last = self.stream_chat(
            messages,
            config,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            chat_template_kwargs=chat_template_kwargs,
            **settings,
        )
        return last.result

    def stream_chat(
        self,
        messages: list[dict],
        config: GenerationConfig | None = None,
        *,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = False,
        chat_template_kwargs: dict | None = None,
        **settings,
    ) -> Iterator[ChatDelta]:
        """The model's reply to a conversation as it is generated, one ChatDelta per piece: its
        `text`, its `reasoning`, and its `parts` with the tool calls (a call's id and name, then its
        arguments as they come); the last delta has the whole turn as `result`, as `chat` returns it."""
        if tools is None and tool_choice is not None:
            raise SettingsError("tool_choice needs tools: pass the tools it chooses from", "tool_choice")
        request = None if tools is None else tool_request(tools, tool_choice, parallel_tool_calls)
        turn = chat_turn(
            self.tokenizer, self.max_context, messages, request, template_variables(chat_template_kwargs), self.manifest.vision or None
        )
        self.runner.see(turn.pictures)
        try:
            pieces = self.stream(turn.ids, config, **turn.settings(settings, config))
        except BaseException:
            self.runner.let_go(turn.pictures)
            raise
        return self._holding(chat_deltas(turn.stream(), pieces), turn.pictures)

    def _holding(self, deltas, pictures):
        """`deltas`, the pictures held in the store until they end (or are let go unfinished)."""
        try:
            yield from deltas
        finally:
            self.runner.let_go(pictures)

    def embed(self, texts, dimensions: int | None = None, truncate: bool = False):
        """Embeddings need an embedding export, which `Engine.load` gives as an Embedder."""
        raise SettingsError(
            "this export generates text; embeddings need an export of an embedding model's hidden states: "
            "edgeinfer export MODEL -o OUT --task embedding, then load OUT",
            "model",
        )

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template, ready for a reply
        (an image's tokens among them, as chat_turn makes them)."""
        return chat_turn(self.tokenizer, self.max_context, messages, vision=self.manifest.vision or None).ids

    def prompt_ids(self, prompt: Prompt, within_context: bool = True) -> list[int]:
        """The prompt's token ids; text that cannot leave room in the context is refused before
        it is encoded, unless `within_context` is False (a prompt to truncate)."""
        context = self.max_context if within_context else None
        return self.tokenizer.prompt_ids(prompt, self.manifest.vocab_size, context, self.runner.images)

    def prepare(
        self, prompts: list[Prompt], config: GenerationConfig | list[GenerationConfig] | None = None, **settings
    ) -> list[Sequence]:
        """Each prompt's Sequence, checked (prepare.py); raises, before any work, on bad settings or prompts."""
        return prepare(self, prompts, config, settings)

    def run(self, sequences: list[Sequence]) -> Iterator[tuple[int, Piece]]:
        """The generation loop of prepared sequences, once their KV cache is known to fit: (row,
        piece) as it is iterated."""
        capacity = max(len(s.prompt_ids) + s.max_new_tokens for s in sequences)
        self.check_memory(len(sequences), capacity)
        return generate(self.runner, sequences, capacity)

    def check_memory(self, num_rows: int, capacity: int) -> None:
        """Raises where `num_rows` rows of `capacity` tokens of KV cache do not fit beside the weights."""
        check_generation(self.memory, num_rows, capacity, self.provider, self.memory_limit)

    def _start(self, prompts: list[Prompt], config, settings: dict) -> Iterator[tuple[int, Piece]]:
        """Check everything, then hand back the generation loop (which does the work as it is iterated)."""
        return self.run(prepare(self, prompts, config, settings))


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


def serving_context(manifest: Manifest, requested: int | None) -> int:
    if requested is not None and requested > manifest.max_context:
        raise SettingsError(
            f"max_context {requested} is more than the export's context of {manifest.max_context} tokens: "
            f"pass at most {manifest.max_context}"
        )
    return requested or manifest.max_context


def _model_defaults(manifest: Manifest) -> GenerationConfig:
    try:
        return GenerationConfig(**manifest.generation)
    except (SettingsError, TypeError) as e:
        raise ManifestError(f"the manifest's generation defaults are invalid ({e}): export the model again") from None


def _is_batch(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(isinstance(p, (str, list, tuple)) for p in prompt)


def _only_pieces(events: Iterator[tuple[int, Piece]]) -> Iterator[Piece]:
    """The pieces of a single prompt's stream; where it failed (a constraint's dead end), its error is raised."""
    try:
        for _, piece in events:
            if piece.error is not None:
                raise piece.error
            yield piece
    finally:
        events.close()
