"""The model runner: the only owner of the graphs, and the only code that builds their inputs.

Each step of generation is one call: `prefill` (whole prompts into a new batch), `prefill_span`
(one chunk of one row's prompt), `decode` (one token for each decoding row), `verify` (several
tokens of one row with the logits of each: speculative decoding's check) and `choose` (each
sequence's next token from the logits). The caches (kv_cache.py) keep the books and each layer's
cache kind (cache_kinds.py) says what its buffers keep; the runner builds each pass's inputs from
the books (inputs.py), runs the graph, and brings the books up to date. The split layout (a
prefill graph beside the decode graph), a decode graph of fixed shapes and the attention as
traced (a past that grows) are its business alone. Beside it: the pictures' features and
positions (pictures.py) and the LoRA adapters' graph and rows (lora_binding.py).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .adapters import Adapters, RowAdapters
from .errors import ConstraintError, GenerationError, ManifestError
from .cache_kinds import FixedState, cache_kinds
from .inputs import LAST_ONLY, prepare_decode, prepare_left_padded, prepare_row, prepare_together
from .lora_binding import AdapterBinding, chain_root
from .kv_cache import GrowingCache, SlotCache, cache_pairs, host_array
from .manifest import GraphSpec, Manifest
from .prefix_cache import PrefixCache, restore_row, store_row
from .runtime import Bindings, Graph, HostCopy, LogitsHeads, RowCopy, RuntimeOptions, Value, host_value, load_weights
from .pictures import IMAGE_INPUT, PictureFeeds
from .sequence import Sequence

STEP_INPUTS = {"input_ids", "attention_mask", "position_ids", "logits_to_keep"}  # besides the KV cache


@dataclass
class Batch:
    """The rows the runner runs together: their KV cache, what stays bound from step to step, and
    (after `prefill`) how many tokens of each prompt came from the prefix cache. With
    `reuses_logits` (the loops, which read each pass's logits before the next), a decode pass
    overwrites one logits value; otherwise each pass returns a new one."""

    cache: GrowingCache | SlotCache
    reuses_logits: bool = False
    bindings: Bindings = field(default_factory=Bindings)
    num_cached: list[int] = field(default_factory=list)
    adapters: RowAdapters | None = None  # the rows' adapters, once one of them runs one
    bound_to: object = None  # the graph `bindings` were made for


class ModelRunner:
    """Runs one export's graphs on one device (see the module's text)."""

    def __init__(
        self,
        folder: Path,
        manifest: Manifest,
        provider: str,
        options: RuntimeOptions,
        max_context: int,
        prefill_chunk: int,
        prefix_budget: int,
    ):
        self.folder, self.manifest, self.kv = Path(folder), manifest, manifest.kv
        self.provider, self.max_context, self.prefill_chunk = provider, max_context, prefill_chunk
        # The split layout's two sessions share one copy of the weights on a GPU; on the CPU each
        # keeps its own pre-packed copy.
        shared = load_weights(self.folder / manifest.graph.file, provider) if manifest.prefill and provider != "cpu" else None
        self.options = options
        self.base_graph = open_graph(self.folder, manifest, manifest.graph, provider, options.threads, shared)
        self.adapters = Adapters(self.folder, manifest, self.kv.dtype)
        # a partial, not a method: no cycle through the runner, which is freed as soon as it is let go
        lora_graph = functools.partial(open_graph, self.folder, manifest, manifest.lora, provider, options.threads, None)
        self.lora = AdapterBinding(self.adapters, self.kv.dtype, lora_graph)
        self.prefill_graph = (
            open_graph(self.folder, manifest, manifest.prefill, provider, options.threads, shared)
            if manifest.prefill is not None
            else None
        )
        self._shared_weights = shared  # the sessions use these values: they live as long as the runner
        self.is_static = manifest.static_context is not None  # the decode graph's shapes are fixed
        self.heads = LogitsHeads(self.graph.output_types["logits"], provider)
        self.copier = self._copier()
        self.exact_windows = provider == "cuda"  # CUDA's windowed buffers hold the window exactly (cache_kinds.window_capacity)
        self.kinds = cache_kinds(self.kv, max_context, self.exact_windows)  # each layer's cache kind
        # Off where a static decode graph would take a prompt's tail one token a pass, where a slot
        # cache has no copier, and where a kind cannot be kept in blocks (a recurrent state).
        usable = (
            not self.is_static
            and all(kind.prefix for kind in self.kinds)
            and self.kv.sequence_axis == 2
            and (not self.kv.in_place or self.copier is not None)
        )
        self.prefix_cache = PrefixCache(prefix_budget if usable else 0)
        self._past_shapes = {name: self.graph.inputs[name].shape for kind in self.kinds for name in kind.names}
        image_dtype = self.graph.input_dtype(IMAGE_INPUT) if manifest.vision else None
        self.pictures = PictureFeeds(self.folder, manifest, provider, options, image_dtype)
        self.images = self.pictures.images  # the store of the pictures' features (None: a text export)

    def see(self, pictures) -> None:
        """Make the features of a prompt's pictures before it runs (PictureFeeds.see)."""
        self.pictures.see(pictures)

    def let_go(self, pictures) -> None:
        self.pictures.let_go(pictures)

    def _copier(self) -> HostCopy | RowCopy | None:
        """What copies a row's tokens between a slot cache's buffers and the host (the prefix cache,
        the split layout's prefill): views on the CPU, an Identity graph on a device."""
        if not self.kv.in_place:
            return None
        if self.provider == "cpu":
            return HostCopy(self.graph)
        return RowCopy(self.kv.dtype, self.provider) if self.kv.dtype in ("float32", "float16") else None

    @property
    def _prefix_on(self) -> bool:
        return bool(self.prefix_cache.budget)

    @property
    def batches_continuously(self) -> bool:
        """Whether rows of one batch can be at different steps (one prefilling beside others
        decoding): a cache written in place, and a decode graph whose shapes are not fixed."""
        return self.kv.in_place and not self.is_static

    @property
    def can_verify(self) -> bool:
        """Whether the graph gives the logits of several positions (speculative decoding checks them)."""
        return "logits_to_keep" in self.graph.inputs

    # The caches.

    def new_batch(self, num_rows: int = 1, capacity: int | None = None, reuses_logits: bool = False) -> Batch:
        """An empty batch of `num_rows` rows of at most `capacity` tokens each, prompt included
        (default: the context served), every row on the base model. A slot cache's buffers are
        allocated here, once."""
        if not self.kv.in_place:
            return Batch(GrowingCache(self.kv, {}, [0] * num_rows), reuses_logits)
        capacity = self.manifest.static_context if self.is_static else capacity or self.max_context
        kinds = cache_kinds(self.kv, capacity, self.exact_windows)
        shapes = self._buffer_shapes(kinds, num_rows, capacity)
        buffers = {name: self.graph.allocate(shape, self.kv.dtype) for name, shape in shapes.items()}
        batch = Batch(SlotCache(self.kv, buffers, num_rows, capacity, kinds), reuses_logits)
        for row in range(num_rows):
            self._reset_row(batch, row)
        return batch

    def _buffer_shapes(self, kinds: list, num_rows: int, capacity: int) -> dict[str, list[int]]:
        """Each cache buffer's shape for `num_rows` rows of `capacity` tokens (0: a past that grows)."""
        shapes = {}
        for kind in kinds:
            shapes.update(kind.buffer_shapes(num_rows, capacity, self._past_shapes, self.kv.sequence_axis))
        return shapes

    def _reset_row(self, batch: Batch, row: int) -> None:
        """The row's buffers as a new prompt starts from them (a recurrent state zeroed)."""
        for kind in batch.cache.kinds:
            kind.reset_row(self.graph.write_row, batch.cache.buffers, row)

    def assign(self, batch: Batch, row: int, adapter: str | None) -> None:
        """Run `row` with LoRA adapter `adapter` (None: the base model) from its next pass on."""
        self.lora.assign(batch, row, adapter)

    @property
    def graph(self) -> Graph:
        """The graph that serves: the base graph, or, once a row has asked for an adapter, the adapters' graph."""
        return self.lora.graph or self.base_graph

    def restore(self, batch: Batch, row: int, ids: list[int]) -> int:
        """Fill an empty row of a slot cache with the cached blocks that start `ids`; how many tokens they hold."""
        if not self._prefix_on:
            return 0
        cache = batch.cache
        num_cached = restore_row(self.prefix_cache, ids, cache.buffers, row, self.copier, chain_root(batch, row), cache.held)
        batch.cache.append([row], num_cached)
        return num_cached

    def store(self, batch: Batch, row: int, ids: list[int]) -> None:
        """Keep the whole blocks of a prompt that a row of a slot cache holds, prefilled."""
        if self._prefix_on:
            store_row(self.prefix_cache, ids, batch.cache.buffers, row, self.copier, chain_root(batch, row), batch.cache.held)

    # Prefill.

    def prefill(self, batch: Batch, prompts: list[list[int]]) -> Value:
        """Prompts into the rows of a new batch, in chunks of `prefill_chunk` (the same logits as one
        pass, with a smaller peak), each starting from the prefix cache where it can; returns the
        last position's logits [rows, 1, vocab], left on the device."""
        if isinstance(batch.cache, GrowingCache):
            return self._prefill_growing(batch, prompts)
        rows = [batch.cache.acquire() for _ in prompts]
        assert rows == list(range(len(prompts))), "prefill fills a new batch"
        if (
            len(prompts) > 1
            and all(kind.pads for kind in batch.cache.kinds)  # else each row alone (cache_kinds: a state, a window)
            and not (self._prefix_on and any(self.prefix_cache.has_start(p, chain_root(batch, row)) for row, p in enumerate(prompts)))
        ):
            logits = self._prefill_together(batch, prompts, max(len(p) for p in prompts))
            batch.num_cached = [0] * len(prompts)
        elif len(prompts) > 1:  # rows from the prefix cache: each alone, then every last token in one pass
            batch.num_cached = [self._prefill_row(batch, row, ids, len(ids) - 1, alone=False)[1] for row, ids in enumerate(prompts)]
            logits = self.decode(batch, [ids[-1] for ids in prompts])
        else:
            logits, num_cached = self._prefill_row(batch, 0, prompts[0], len(prompts[0]))
            batch.num_cached = [num_cached]
        for row, ids in enumerate(prompts):
            self.store(batch, row, ids)
        return logits

    def _prefill_row(self, batch: Batch, row: int, ids: list[int], end: int, alone: bool = True) -> tuple[Value | None, int]:
        """The first `end` tokens of `ids` into `row`, after those the prefix cache holds: the
        logits of the last pass (None where nothing ran), and how many came from the cache. The
        split layout's prefill graph serves a batch's only row (`alone`)."""
        logits, num_cached = None, self.restore(batch, row, ids)
        for start, stop in self.pictures.passes(self.spans(num_cached, end, alone), [ids[:end]]):
            if start == 0 and alone and self.prefill_graph is not None:
                logits = self._prefill_together(batch, [ids], stop)
            else:
                logits = self.prefill_span(batch, row, ids, start, stop)
            # a window evicts: a chunk's blocks are kept while it holds them (the whole prompt's by `prefill`)
            if batch.cache.evicts and stop < len(ids):
                self.store(batch, row, ids[:stop])
        return logits, num_cached

    def spans(self, start: int, end: int, by_prefill_graph: bool = True) -> Iterator[tuple[int, int]]:
        """(start, stop) of each prefill pass over positions start..end of one prompt: the split
        layout's prefill graph reads the first (of its fixed length, where it has one); a decode
        graph of fixed shapes takes one token a pass."""
        if start == 0 and by_prefill_graph and self.prefill_graph is not None and end > 0:
            start = min(self.manifest.prefill_length or self.prefill_chunk, end)
            yield 0, start
        step = 1 if self.is_static else self.prefill_chunk
        for begin in range(start, end, step):
            yield begin, min(begin + step, end)

    def prefill_span(self, batch: Batch, row: int, ids: list[int], start: int, end: int) -> Value:
        """Tokens start..end of a prompt into `row` of a slot cache that holds its first `start`,
        run on that row alone (GroupQueryAttention takes several tokens on a filled cache only for a
        batch of one); returns the last position's logits [1, 1, vocab]."""
        if start == 0:
            self._reset_row(batch, row)
        inputs = {**prepare_row(batch.cache, row, ids[start:end], self.is_static), "logits_to_keep": LAST_ONLY}
        return self._run_row(batch, row, self.pictures.prompt_positions(inputs, batch.cache, [row], [ids], start))

    def _prefill_together(self, batch: Batch, prompts: list[list[int]], length: int) -> Value:
        """The first `length` tokens of every prompt into empty rows 0.. of a slot cache in one
        pass (through the split layout's prefill graph where there is one, padded to its length)."""
        fixed = self.manifest.prefill_length if self.prefill_graph is not None else None
        width = max(length, fixed or 0)
        if fixed and len(prompts) > 1 and length > fixed:
            raise GenerationError(
                f"the longest prompt of this batch has {length} tokens, more than the "
                f"{fixed} positions of this export's prefill graph, which a batch must fit: run such prompts "
                "one at a time, or export with a larger --prefill-length"
            )
        inputs = prepare_together(batch.cache, prompts, length, width)
        inputs = self.pictures.feeds(self.pictures.prompt_positions(inputs, batch.cache, list(range(len(prompts))), prompts))
        lengths = batch.cache.lengths[: len(prompts)]
        if self.prefill_graph is None:
            binding = self._bind_rows(batch, 0, len(prompts))
            binding.run(inputs)
            return binding.outputs()[-1]
        graph = self.prefill_graph
        outputs, _ = graph.run(
            {k: v for k, v in inputs.items() if k in graph.inputs}, on_device=[*self.kv.present, "logits"], to_host=[]
        )
        for past, present in zip(self.kv.past, self.kv.present):  # the presents [rows, kv_heads, width, head_size]
            self.copier.fill(batch.cache.buffers[past], outputs[present], int(lengths.max()))
        return outputs["logits"]

    def _prefill_growing(self, batch: Batch, prompts: list[list[int]]) -> Value:
        """Prompts left-padded to the longest into a cache that grows, chunk by chunk; a single
        prompt starts from the prefix cache's blocks and leaves its own there."""
        cache, first = batch.cache, self.manifest.prefill_length if self.prefill_graph is not None else None
        width = max(max(len(p) for p in prompts), first or 0)
        if not all(kind.pads for kind in cache.kinds) and len(prompts) > 1:
            return self._prefill_growing_apart(batch, prompts)
        shapes = self._buffer_shapes(cache.kinds, len(prompts), 0)
        buffers = {name: np.zeros(shape, np.dtype(self.kv.dtype)) for name, shape in shapes.items()}
        root = chain_root(batch, 0)
        num_cached, blocks = self.prefix_cache.take(prompts[0], root) if self._prefix_on and len(prompts) == 1 else (0, {})
        buffers.update({name: value[None] for name, value in blocks.items()})
        cache.buffers, batch.num_cached = buffers, [num_cached] + [0] * (len(prompts) - 1)
        cache.fill(num_cached, np.full(len(prompts), num_cached, np.int64))
        spans = self.pictures.passes(self.spans(num_cached, width), prompts, width)
        positions = self.pictures.left_padded_positions(cache, prompts, width)
        for start, end, inputs in prepare_left_padded(cache, prompts, width, iter(spans)):
            if positions is not None:
                inputs["position_ids"] = positions[:, :, start:end]
            graph = self.prefill_graph if start == 0 and self.prefill_graph else self.graph
            logits = self._run_growing(batch, inputs, graph)
        if self._prefix_on and len(prompts) == 1:
            self.prefix_cache.store(prompts[0], {name: host_array(value)[0] for name, value in cache.buffers.items()}, root)
        return logits

    def _prefill_growing_apart(self, batch: Batch, prompts: list[list[int]]) -> Value:
        """A traced-attention hybrid's prompts (a state reads a pass's padding as tokens): each
        prefilled alone, then laid side by side as a growing cache holds them, the keys and values
        left-padded with zeros to the longest, the states stacked."""
        if batch.adapters is not None:
            raise GenerationError(
                "this export keeps the attention as traced and a recurrent state, whose prompts are prefilled one at a "
                "time: run prompts with adapters one by one"
            )
        alone = [Batch(GrowingCache(self.kv, {}, [0])) for _ in prompts]
        logits = [host_array(self._prefill_growing(one, [ids])) for one, ids in zip(alone, prompts)]
        width, axis = max(len(p) for p in prompts), self.kv.sequence_axis

        def left_padded(value: np.ndarray) -> np.ndarray:
            pad = [(0, 0)] * value.ndim
            pad[axis] = (width - value.shape[axis], 0)
            return np.pad(value, pad)

        def side_by_side(kind, name: str) -> np.ndarray:
            values = [host_array(one.cache.buffers[name]) for one in alone]
            return np.concatenate(values if isinstance(kind, FixedState) else [left_padded(v) for v in values])

        buffers = {name: side_by_side(kind, name) for kind in batch.cache.kinds for name in kind.names}
        batch.cache.buffers, batch.num_cached = buffers, [one.num_cached[0] for one in alone]
        batch.cache.fill(width, np.array([len(p) for p in prompts], np.int64))
        batch.cache.shifts = np.concatenate([one.cache.shifts for one in alone])
        return host_value(np.concatenate(logits))

    # Decode and verify.

    def decode(self, batch: Batch, tokens: list[int | None]) -> Value:
        """One pass over rows 0..len(tokens)-1, one new token for each row that has one (None: a
        row not decoding, which gets a pad token written just past its own, where its next pass
        writes again); returns the logits [rows, 1, vocab], left on the device. A slot cache's pass
        keeps its binding (and, where the batch reuses logits, one logits value per number of rows)."""
        inputs = prepare_decode(batch.cache, tokens, self.is_static)
        if isinstance(batch.cache, GrowingCache):
            return self._run_growing(batch, inputs, self.graph)
        inputs = self.pictures.feeds(self.pictures.text_positions(inputs, batch.cache, slice(0, len(tokens))))
        binding, logits = self._decode_binding(batch, len(tokens))
        idle = {row: self.row_state(batch, row, 1) for row, token in enumerate(tokens) if token is None}
        binding.run(inputs, fresh=() if batch.reuses_logits else ("logits",))
        for row, state in idle.items():  # a state read the pad token of a row not decoding (or a window moved): put it back
            self._put_state(batch, row, state)
        return logits if batch.reuses_logits else binding.outputs()[-1]

    def row_state(self, batch: Batch, row: int, ahead: int) -> dict:
        """A copy of what the row could not forget after `ahead` more tokens: its recurrent state
        (hybrid models), and the buffers of the layers that keep a window where those tokens move
        it; empty where the cache can forget them. What `take_back` puts back where a speculative
        pass's tokens are rejected."""
        kinds = batch.cache.moving(row, ahead)
        return {name: self.graph.read_row(batch.cache.buffers[name], row) for kind in kinds for name in kind.names}

    def _put_state(self, batch: Batch, row: int, state: dict) -> None:
        """Write `state` (from `row_state`) back into the row's buffers."""
        for name, values in state.items():
            self.graph.write_row(batch.cache.buffers[name], row, values)

    def take_back(self, batch: Batch, row: int, tokens: list[int], count: int, state: dict) -> None:
        """Forget the last `count` of the `tokens` a verify pass ran on the row. A recurrent state
        cannot forget what it read, nor a window what it evicted: they are put back as they were
        before the pass (`state`, from `row_state`), and the tokens kept run again, one pass more."""
        if count <= 0:
            return
        if not state:
            batch.cache.trim(row, count)
            return
        batch.cache.trim(row, len(tokens), state_put_back=True)
        self._put_state(batch, row, state)
        self.verify(batch, row, tokens[:-count], num_logits=1)

    def verify(self, batch: Batch, row: int, tokens: list[int], num_logits: int | None = None) -> Value:
        """Several new tokens of one row in one pass, with the logits of each (of the last
        `num_logits`, where given), [1, positions, vocab], left on the device."""
        if not self.can_verify:
            raise GenerationError(
                "this export gives the logits of the last position only: export the model again with this "
                "edgeinfer (`edgeinfer export`)"
            )
        if self.is_static and len(tokens) > 1:  # one token a pass
            logits = np.concatenate([self.verify(batch, row, [t]).numpy() for t in tokens][-(num_logits or len(tokens)) :], axis=1)
            return host_value(logits)
        inputs = {
            **prepare_row(batch.cache, row, tokens, self.is_static),
            "logits_to_keep": np.array(num_logits or len(tokens), np.int64),
        }
        if isinstance(batch.cache, SlotCache):
            return self._run_row(batch, row, inputs)
        return self._run_growing(batch, inputs, self.graph)

    # Choosing tokens.

    def choose(
        self, logits: Value, sequences: list[Sequence], positions: list[int], bindings: Bindings | None = None
    ) -> list[int | ConstraintError]:
        """Each sequence's next token from the logits of the pass at its position (its row), or the
        ConstraintError of one whose constraint reached a dead end. Argmax runs on the device that
        holds the logits; sampling brings the last position's logits to the host."""
        if all(s.chooses_by_argmax for s in sequences):
            ids = self.heads.argmax(logits, bindings)
            return [ids[p] for p in positions]
        last = self.heads.last(logits)
        return [_choose(s, last[p]) for s, p in zip(sequences, positions)]

    # Running the graph.

    def _run_row(self, batch: Batch, row: int, inputs: dict) -> Value:
        """One pass on one row of a slot cache, bound alone (the binding kept in the batch)."""
        binding = self._bindings(batch).rows.get(row)
        if binding is None:
            binding = batch.bindings.rows[row] = self._bind_rows(batch, row, 1)
        self.lora.bind(binding, batch, row, 1)
        binding.run(self.pictures.feeds(self.pictures.text_positions(inputs, batch.cache, slice(row, row + 1))), fresh=("logits",))
        return binding.outputs()[-1]

    def _decode_binding(self, batch: Batch, num_rows: int):
        """The binding of a decode pass over rows 0..num_rows-1 and the logits value it overwrites."""
        if num_rows not in self._bindings(batch).decode:
            logits = self.graph.allocate_output("logits", [num_rows, 1, self.manifest.vocab_size])
            batch.bindings.decode[num_rows] = (self._bind_rows(batch, 0, num_rows, logits), logits)
        binding, logits = batch.bindings.decode[num_rows]
        self.lora.bind(binding, batch, 0, num_rows)
        return binding, logits

    def _bindings(self, batch: Batch) -> Bindings:
        """The batch's bindings, made anew where the graph they were made for no longer serves."""
        if batch.bound_to is not self.graph:
            batch.bindings.decode.clear()
            batch.bindings.rows.clear()
            batch.bound_to = self.graph
        return batch.bindings

    def _bind_rows(self, batch: Batch, first: int, rows: int, logits: Value | None = None):
        """`Graph.bind_rows` of the batch's cache on the graph that serves, its adapters bound too."""
        binding = self.graph.bind_rows(batch.cache.pooled, first, rows, logits)
        self.lora.bind(binding, batch, first, rows)
        return binding

    def _run_growing(self, batch: Batch, inputs: dict, graph: Graph) -> Value:
        """One pass on a cache that grows: the past bound where it is, the presents kept on the device."""
        cache = batch.cache
        adapters = self.lora.views(batch, 0, len(cache.lengths))[1]
        inputs = {**self.pictures.feeds(inputs), **adapters}
        inputs = {name: value for name, value in inputs.items() if name in graph.inputs}
        inputs = self.pictures.text_positions(inputs, cache, slice(None))
        past = cache.buffers if graph is self.graph else {}
        presents = [present for _, present in cache_pairs(self.kv)]
        outputs, _ = graph.run({**inputs, **past}, on_device=[*presents, "logits"], to_host=[])
        cache.take(outputs)
        return outputs["logits"]


def _choose(sequence: Sequence, logits: np.ndarray) -> int | ConstraintError:
    try:
        return sequence.choose(logits)
    except ConstraintError as error:
        return error


def open_graph(folder: Path, manifest: Manifest, spec: GraphSpec, provider: str, threads: int | None, shared: dict | None) -> Graph:
    """One of the export's graphs in a session, refused where it takes an input the runner cannot fill."""
    graph = Graph(folder / spec.file, provider, threads, shared, quantized=manifest.precision in ("int4", "int8"))
    graph.check_names(spec.inputs, spec.outputs)
    adapters = {n for n in graph.inputs if n.startswith("lora.")} if spec is manifest.lora else set()
    images = {IMAGE_INPUT} if manifest.vision else set()
    unknown = set(graph.inputs) - STEP_INPUTS - images - {past for past, _ in cache_pairs(manifest.kv)} - adapters
    if unknown:
        raise ManifestError(f"{spec.file} takes inputs edgeinfer cannot fill: {sorted(unknown)}; export it with `edgeinfer export`")
    return graph
