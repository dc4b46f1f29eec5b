"""The KV cache of one generation: the only code that knows how present becomes past, and which
of its slots hold real tokens (the attention mask) for every row of a batch."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .errors import GenerationError
from .manifest import KVSpec

PAD_ID = 0  # fed where a row has no token: left padding, and rows that have already ended
LAST_ONLY = np.array(1, np.int64)  # `logits_to_keep` of a pass whose last position alone is read


class KVCache:
    """Holds the past keys and values as OrtValues on the engine's device, and the attention
    mask over them.

    The keys and values are never copied to the host: each step's `present.*` outputs are kept
    on the device by the runtime and bound, as they are, as the next step's `past_key_values.*`
    inputs. Prompts of a batch are left-padded, so every row's newest token is at the end.
    """

    def __init__(self, spec: KVSpec, past_shapes: dict[str, list], prefix: PrefixCache | None = None, host=None):
        """`past_shapes`: each past input's shape as the graph declares it (numbers, and names for
        the batch and the past's length). With `prefix` and `host` (the graph, which copies device
        values to the host), a single prompt starts from the cached blocks it begins with, and
        leaves its own there."""
        self.spec = spec
        self.past_shapes = past_shapes
        self.past: dict = {}
        self.mask = np.zeros((0, 0), np.int64)  # [batch, length]: 1 where a slot holds a real token
        self.empty_past = True  # during prefill: whether the chunk being run starts on an empty cache
        self.cached: list[int] = []  # after prefill: each row's prompt tokens taken from the prefix cache
        self._prefix = prefix if prefix is not None and prefix.budget and host is not None else None
        self._host = host

    @property
    def length(self) -> int:
        """Slots in the cache (padding included)."""
        return self.mask.shape[1]

    def prefill_chunks(self, prompts: list[list[int]], chunk: int, first: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """Inputs of the graph for `prompts`, left-padded to the longest, `chunk` positions at a
        time: the first chunk on an empty past, each later one on the cache the previous ones
        filled (the same logits as one pass, with a smaller peak of activations). With `first`
        (a prefill graph of fixed length), the first chunk has exactly that many positions,
        padded. `empty_past` says, at each chunk, whether the cache holds nothing yet."""
        width = max(max(len(p) for p in prompts), first or 0)
        ids = np.full((len(prompts), width), PAD_ID, np.int64)
        mask = np.zeros((len(prompts), width), np.int64)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = prompt
            mask[row, width - len(prompt):] = 1
        positions = np.maximum(mask.cumsum(axis=1) - 1, 0)
        self.past = {name: self._empty(name, len(prompts)) for name in self.spec.past}
        cached = 0
        if self._prefix is not None and len(prompts) == 1:
            cached, blocks = self._prefix.take(prompts[0])
            self.past.update({name: value[None] for name, value in blocks.items()})
        self.cached = [cached] + [0] * (len(prompts) - 1)
        for start, end in _chunks(cached, width, chunk, first):
            self.mask, self.empty_past = mask[:, :end], start == 0
            yield {"input_ids": ids[:, start:end], "attention_mask": self.mask, "position_ids": positions[:, start:end],
                   "logits_to_keep": LAST_ONLY}
        if self._prefix is not None and len(prompts) == 1:
            self._prefix.store(prompts[0], {name: self._host.read(value)[0] for name, value in self.past.items()})

    def prefills_by_row(self, prompts: list[list[int]]) -> bool:
        """Whether `prefill_rows` serves these prompts (a batch whose rows start from the prefix
        cache) instead of `prefill_chunks`."""
        return False

    def _empty(self, name: str, batch: int) -> np.ndarray:
        """A past of zero tokens, for prefill: the declared shape with the batch filled in."""
        shape = [0 if axis == self.spec.sequence_axis else (dim if isinstance(dim, int) else batch)
                 for axis, dim in enumerate(self.past_shapes[name])]
        return np.zeros(shape, np.dtype(self.spec.dtype))

    def decode_inputs(self, tokens: list[int]) -> dict[str, np.ndarray]:
        """Inputs of the decode graph for one new token per row, on top of the cache."""
        positions = self.mask.sum(axis=1, keepdims=True)
        self.mask = np.concatenate([self.mask, np.ones((len(tokens), 1), np.int64)], axis=1)
        return {"input_ids": np.array(tokens, np.int64)[:, None], "attention_mask": self.mask, "position_ids": positions,
                "logits_to_keep": LAST_ONLY}

    def extend_inputs(self, row: int, tokens: list[int], keep: int | None = None) -> dict[str, np.ndarray]:
        """Inputs for several new tokens of one row on top of the cache, with logits for each (for
        the last `keep` only, where given). This layout serves it for a batch of one."""
        if self.mask.shape[0] != 1:
            raise GenerationError("this export keeps optimum-onnx's attention, whose cache serves speculative decoding for "
                                  "one prompt at a time: generate the prompts one by one")
        start = self.length
        self.mask = np.ones((1, start + len(tokens)), np.int64)
        return {"input_ids": np.array([tokens], np.int64), "attention_mask": self.mask,
                "position_ids": np.arange(start, start + len(tokens), dtype=np.int64)[None, :],
                "logits_to_keep": np.array(keep or len(tokens), np.int64)}

    def drop(self, row: int, count: int) -> None:
        """Forget the row's last `count` tokens (proposed tokens the model rejected): the past is
        cut to the rest (a copy through the host in this layout)."""
        if count <= 0:
            return
        keep = self.length - count
        cut = (slice(None),) * self.spec.sequence_axis + (slice(0, keep),)
        self.past = {name: np.ascontiguousarray((value if isinstance(value, np.ndarray) else self._host.read(value))[cut])
                     for name, value in self.past.items()}
        self.mask = self.mask[:, :keep]

    @property
    def keep(self) -> list[str]:
        """Outputs of a pass the runtime keeps on the device for the next one."""
        return self.spec.present

    @property
    def into(self) -> dict:
        """Outputs of a pass written into buffers the cache already holds (none here)."""
        return {}

    def update(self, present: dict) -> None:
        """Take a pass's present outputs as the past of the next pass."""
        self.past = {past: present[name] for past, name in zip(self.spec.past, self.spec.present)}

    def fill(self, present: dict) -> None:
        """Take the presents of the prefill graph (the split layout's, which has no past) as the past."""
        self.update(present)


def _chunks(start: int, width: int, chunk: int, first: int | None) -> Iterator[tuple[int, int]]:
    """The (start, end) of each chunk of positions start..width: `chunk` at a time; where `first`
    is given and the past is empty, the first chunk is exactly `first` long (past `width`: padded)."""
    if start == 0 and first is not None:
        yield 0, first
        start = first
    for begin in range(start, width, chunk):
        yield begin, min(begin + chunk, width)


class _RowsInPlace:
    """Several new tokens on one row of buffers written in place (speculative decoding's checks),
    for a cache or a pool that keeps each row's `lengths` within `capacity` slots."""

    lengths: np.ndarray
    capacity: int
    static: bool = False  # the graph's attention mask spans the whole capacity (a static-shape decode graph)

    def extend_inputs(self, row: int, tokens: list[int], keep: int | None = None) -> dict[str, np.ndarray]:
        """Inputs for `tokens` on top of the row's slots, with the logits of each (of the last
        `keep`, where given), run on that row alone (`pooled`): GroupQueryAttention takes several
        tokens on a filled cache only for a batch of one."""
        return _extend_row(self.lengths, row, tokens, self.capacity, keep, self.static)

    def drop(self, row: int, count: int) -> None:
        """Forget the row's last `count` tokens (proposed tokens the model rejected): its length
        goes back, and the next pass writes over them."""
        self.lengths[row] -= max(count, 0)


class InPlaceKVCache(_RowsInPlace, KVCache):
    """The KV cache of a graph whose attention writes into its past (`kv.in_place`, export's
    GroupQueryAttention): one buffer per past input, [batch, kv_heads, capacity, head_size],
    allocated once on the engine's device and bound as both past and present at every step, so
    nothing is copied or reallocated as the context grows.

    Rows are right-padded: each row's tokens fill its slots from 0, and the attention mask says
    how many each row has (the graph derives its lengths from it).
    """

    def __init__(self, spec: KVSpec, past_shapes: dict[str, list], capacity: int, allocate,
                 prefix: PrefixCache | None = None, host=None, copy=None, static: bool = False):
        """`capacity`: slots per row (prompt plus new tokens); `allocate(shape, dtype)` makes an
        uninitialised buffer on the engine's device. With `prefix`, a prompt (or each row of a
        batch) starts from the cached blocks it begins with, and leaves its own there: through
        views of the buffers given `host` (the graph, on the CPU provider), or through `copy`
        (runtime.RowCopy: the row's cached tokens, head by head) on other devices. `static`: the
        graph's attention mask spans all `capacity` slots (a decode graph of fixed shapes)."""
        super().__init__(spec, past_shapes, prefix, host)
        self.capacity, self.static = capacity, static
        self._allocate = allocate
        self.lengths = np.zeros(0, np.int64)
        self._copy = copy

    def prefill_chunks(self, prompts: list[list[int]], chunk: int, first: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """A single prompt `chunk` tokens at a time; a batch in one pass, since ONNX Runtime's
        GroupQueryAttention refuses a pass of several tokens on a cache that holds some already
        ("batch_size must be 1 when sequence_length > 1 and past context is given"). With `first`
        (a prefill graph of fixed length), the first chunk has exactly that many positions, padded."""
        width = max(len(p) for p in prompts)
        if width > self.capacity:
            raise GenerationError(f"a prompt of {width} tokens does not fit a cache of {self.capacity} slots: "
                                  "make the cache with a larger capacity")
        if first is not None and len(prompts) > 1 and width > first:
            raise GenerationError(f"the longest prompt of this batch has {width} tokens, more than the {first} positions of "
                                  "this export's prefill graph, which a batch must fit: run such prompts one at a time, or "
                                  f"export with a larger --prefill-length")
        self.past = {name: self._allocate(self._buffer_shape(name, len(prompts)), self.spec.dtype) for name in self.spec.past}
        chunk = width if len(prompts) > 1 else chunk
        ids = np.full((len(prompts), max(width, first or 0)), PAD_ID, np.int64)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = prompt
        final = np.array([len(p) for p in prompts], np.int64)
        cached = self._restore(prompts[0]) if self._prefix is not None and len(prompts) == 1 else 0
        self.cached = [cached] + [0] * (len(prompts) - 1)
        for start, end in _chunks(cached, width, chunk, first):
            self.lengths, self.empty_past = np.minimum(final, end), start == 0
            positions = np.tile(np.arange(start, end), (len(prompts), 1))
            mask = self._mask(end) if start == 0 else self._mask(self._width(end))
            yield {"input_ids": ids[:, start:end], "attention_mask": mask, "position_ids": positions,
                   "logits_to_keep": LAST_ONLY}
        if self._prefix is not None:
            self._store(prompts)

    def prefills_by_row(self, prompts: list[list[int]]) -> bool:
        return len(prompts) > 1 and self._prefix is not None and any(self._prefix.has_start(p) for p in prompts)

    def prefill_rows(self, prompts: list[list[int]], chunk: int) -> Iterator[tuple[int | None, dict[str, np.ndarray]]]:
        """A batch whose rows start from the prefix cache: (row, inputs) for each chunk of each row
        but its last token, run on that row alone after its cached blocks are copied in
        (GroupQueryAttention takes several tokens on a filled cache only for a batch of one), then
        (None, inputs) for every row's last token in one pass, whose logits choose the first new
        tokens. Each row leaves its whole blocks in the prefix cache."""
        if max(len(p) for p in prompts) > self.capacity:
            raise GenerationError(f"a prompt of {max(len(p) for p in prompts)} tokens does not fit a cache of {self.capacity} "
                                  "slots: make the cache with a larger capacity")
        self.past = {name: self._allocate(self._buffer_shape(name, len(prompts)), self.spec.dtype) for name in self.spec.past}
        self.lengths = np.zeros(len(prompts), np.int64)
        self.cached = [0] * len(prompts)
        for row, prompt in enumerate(prompts):
            self.lengths[row] = self.cached[row] = self._restore(prompt, row)
            for start in range(int(self.lengths[row]), len(prompt) - 1, chunk):
                yield row, _extend_row(self.lengths, row, prompt[start:min(start + chunk, len(prompt) - 1)], self.capacity, keep=1)
        yield None, self.decode_inputs([p[-1] for p in prompts])
        self._store(prompts)

    def _store(self, prompts: list[list[int]]) -> None:
        """Keep each prefilled row's whole blocks (rows are right-padded: a row's tokens start at slot 0)."""
        views = self._views()
        for row, prompt in enumerate(prompts):
            _store_row(self._prefix, prompt, row, self.past, views, self._copy)

    def _restore(self, prompt: list[int], row: int = 0) -> int:
        """The cached start of `prompt` written into `row` of the buffers; how many tokens it holds."""
        return _restore_row(self._prefix, prompt, row, self.past, self._views(), self._copy)

    def _views(self) -> dict[str, np.ndarray] | None:
        """Each buffer viewed on the host, where there is no `copy` to go through."""
        return None if self._copy is not None else {name: self._host.host_view(value) for name, value in self.past.items()}

    def _buffer_shape(self, name: str, batch: int) -> list[int]:
        return _buffer_shape(self.spec, self.past_shapes[name], batch, self.capacity)

    def _mask(self, width: int) -> np.ndarray:
        return (np.arange(width)[None, :] < self.lengths[:, None]).astype(np.int64)

    def _width(self, length: int) -> int:
        """The attention mask's width for a pass of the decode graph on `length` slots."""
        return self.capacity if self.static else length

    def fill(self, present: dict) -> None:
        """Copy the presents of the prefill graph (the split layout's, which has no past: each
        [batch, kv_heads, positions, head_size]) into the first slots of the buffers."""
        slots = self.length
        for past, name in zip(self.spec.past, self.spec.present):
            if self._copy is not None:
                self._copy.fill(self.past[past], present[name], slots)
            else:
                self._host.host_view(self.past[past])[:, :, :slots] = self._host.host_view(present[name])[:, :, :slots]

    @property
    def length(self) -> int:
        return int(self.lengths.max(initial=0))

    def decode_inputs(self, tokens: list[int]) -> dict[str, np.ndarray]:
        positions = self.lengths[:, None].copy()
        self.lengths = self.lengths + 1
        if self.length > self.capacity:
            raise GenerationError(f"the cache's {self.capacity} slots are full: make the cache with a larger capacity")
        self.mask = self._mask(self._width(self.length))
        return {"input_ids": np.array(tokens, np.int64)[:, None], "attention_mask": self.mask, "position_ids": positions,
                "logits_to_keep": LAST_ONLY}

    @property
    def pooled(self) -> dict:
        """Each past input's buffer with the present output written into it (`Graph.bind_rows`)."""
        return {past: (self.past[past], present) for past, present in zip(self.spec.past, self.spec.present)}

    @property
    def keep(self) -> list[str]:
        return []

    @property
    def into(self) -> dict:
        return {present: self.past[past] for past, present in zip(self.spec.past, self.spec.present)}

    def update(self, present: dict) -> None:
        """Nothing to do: the pass wrote into the buffers."""


class SlotPool(_RowsInPlace):
    """The KV cache of continuous batching (scheduler.py): one buffer per past input,
    [max_batch, kv_heads, capacity, head_size], allocated once on the engine's device and shared by
    many generations, each holding one row (a slot) from admission to its end.

    A prompt is prefilled into its slot alone (the graph runs on that row: GroupQueryAttention takes
    a pass of several tokens on a filled cache only for a batch of one), in chunks. Decode runs on
    the first `rows` rows at once, one token each. Rows in that range that are not decoding (free,
    or part-way through their prefill) get a pad token, written just past their own tokens, where
    their next prefill chunk or first decode writes again: nothing they hold is disturbed.
    """

    def __init__(self, spec: KVSpec, past_shapes: dict[str, list], max_batch: int, capacity: int, allocate,
                 prefix: PrefixCache | None = None, host=None, copy=None):
        """With `prefix`, a prompt starts from the cached blocks it begins with (`restore`), and
        leaves its own there once prefilled (`store`): through views of the buffers given `host`
        (the graph, on the CPU provider), or through `copy` (runtime.RowCopy) on other devices."""
        self.spec, self.capacity = spec, capacity
        self.buffers = {past: allocate(_buffer_shape(spec, past_shapes[past], max_batch, capacity), spec.dtype)
                        for past in spec.past}
        self.lengths = np.zeros(max_batch, np.int64)  # tokens each slot holds
        self._free = list(range(max_batch))
        on = prefix is not None and prefix.budget and (host is not None or copy is not None)
        self._prefix, self._copy = (prefix if on else None), copy
        self._views = {name: host.host_view(value) for name, value in self.buffers.items()} if on and copy is None else None

    def restore(self, slot: int, ids: list[int]) -> int:
        """Fill `slot` with the cached blocks that start `ids`; returns how many tokens they hold."""
        if self._prefix is None:
            return 0
        self.lengths[slot] = _restore_row(self._prefix, ids, slot, self.buffers, self._views, self._copy)
        return int(self.lengths[slot])

    def store(self, slot: int, ids: list[int]) -> None:
        """Keep the blocks of a prompt that `slot` holds, prefilled."""
        if self._prefix is not None:
            _store_row(self._prefix, ids, slot, self.buffers, self._views, self._copy)

    @property
    def pooled(self) -> dict:
        """Each past input's buffer with the present output written into it."""
        return {past: (self.buffers[past], present) for past, present in zip(self.spec.past, self.spec.present)}

    def acquire(self) -> int | None:
        """The lowest free slot (decode passes cover the rows up to the highest one in use), or None."""
        if not self._free:
            return None
        self._free.sort()
        return self._free.pop(0)

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def prefill_inputs(self, slot: int, ids: list[int], start: int, end: int) -> dict[str, np.ndarray]:
        """Inputs for tokens start..end of a prompt going into `slot`, after its first `start`."""
        if end > self.capacity:
            raise GenerationError(f"a prompt of {end} tokens does not fit the pool's {self.capacity} slots per row")
        self.lengths[slot] = end
        return {"input_ids": np.array([ids[start:end]], np.int64), "attention_mask": np.ones((1, end), np.int64),
                "position_ids": np.arange(start, end, dtype=np.int64)[None, :], "logits_to_keep": LAST_ONLY}

    def decode_inputs(self, rows: int, tokens: dict[int, int]) -> dict[str, np.ndarray]:
        """Inputs for one decode pass on the first `rows` slots: `tokens` maps each decoding slot to
        its newest token; the others get a pad token that writes just past their own."""
        lengths = self.lengths[:rows]
        if any(lengths[slot] >= self.capacity for slot in tokens):
            raise GenerationError(f"a row of the pool is full ({self.capacity} slots)")
        ids = np.full((rows, 1), PAD_ID, np.int64)
        for slot, token in tokens.items():
            ids[slot, 0] = token
        mask = (np.arange(int(lengths.max()) + 1)[None, :] <= lengths[:, None]).astype(np.int64)
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": lengths[:, None].copy(), "logits_to_keep": LAST_ONLY}
        for slot in tokens:
            self.lengths[slot] += 1
        return inputs


def _restore_row(prefix: PrefixCache, ids: list[int], row: int, buffers: dict, views: dict | None, copy) -> int:
    """The cached blocks that start `ids` written into `row` of `buffers`, through their host
    `views` where given, else through `copy` (runtime.RowCopy); how many tokens they hold."""
    if views is not None:
        return prefix.restore(ids, {name: view[row] for name, view in views.items()})
    cached, blocks = prefix.take(ids)
    for name, values in blocks.items():
        copy.write(buffers[name], row, values)
    return cached


def _store_row(prefix: PrefixCache, ids: list[int], row: int, buffers: dict, views: dict | None, copy) -> None:
    """Keep the whole blocks of `ids`, prefilled in `row` of `buffers` (views or copy as in _restore_row)."""
    if views is not None:
        prefix.store(ids, {name: view[row] for name, view in views.items()})
        return
    whole = len(ids) // prefix.block * prefix.block
    if whole:
        prefix.store(ids, {name: copy.read(buffer, row, whole) for name, buffer in buffers.items()})


def _extend_row(lengths: np.ndarray, row: int, tokens: list[int], capacity: int, keep: int | None = None,
                static: bool = False) -> dict[str, np.ndarray]:
    """Inputs for `tokens` on top of the `lengths[row]` slots row `row` holds (run on that row
    alone), with the logits of each (of the last `keep`); the row's length grows by them. A
    `static` graph's mask spans the whole capacity."""
    start, end = int(lengths[row]), int(lengths[row]) + len(tokens)
    if end > capacity:
        raise GenerationError(f"the cache's {capacity} slots per row are full: make the cache with a larger capacity")
    lengths[row] = end
    mask = (np.arange(capacity if static else end) < end).astype(np.int64)[None, :]
    return {"input_ids": np.array([tokens], np.int64), "attention_mask": mask,
            "position_ids": np.arange(start, end, dtype=np.int64)[None, :], "logits_to_keep": np.array(keep or len(tokens), np.int64)}


def _buffer_shape(spec: KVSpec, declared: list, batch: int, capacity: int) -> list[int]:
    return [capacity if axis == spec.sequence_axis else (dim if isinstance(dim, int) else batch) for axis, dim in enumerate(declared)]


@dataclass
class _Block:
    id: int
    kv: dict[str, np.ndarray]  # each past input's keys or values of the block's tokens [kv_heads, block, head_size]


@dataclass
class PrefixCache:
    """Keys and values of recent prompts, kept on the host in blocks of `block` tokens, so that a
    prompt that starts like an earlier one prefills only the rest (a system prompt, a document
    asked about again, a conversation's earlier turns). A block is found by its tokens and the
    block before it, so it stands for its tokens and every token before them, compared exactly.
    Blocks used least recently leave first once `budget` bytes are held; 0 turns it off.

    `restore` writes blocks into rows of a cache written in place ([kv_heads, capacity, head_size]
    each); `take` joins them into the first past of a cache that grows from it; `store` keeps a
    prefilled prompt's blocks."""

    budget: int
    block: int = 32
    hits: int = 0  # prompt tokens that came from the cache
    misses: int = 0  # prompt tokens that were prefilled
    held: int = 0  # bytes
    _blocks: OrderedDict = field(default_factory=OrderedDict)  # (parent id, tokens) -> _Block
    _next_id: int = 1
    _lock: threading.Lock = field(default_factory=threading.Lock)  # an engine serves many threads

    def has_start(self, ids: list[int]) -> bool:
        """Whether the first block of `ids` is cached (counted neither as hit nor as miss)."""
        with self._lock:
            return bool(self.budget) and len(ids) > self.block and (0, tuple(ids[:self.block])) in self._blocks

    def restore(self, ids: list[int], rows: dict[str, np.ndarray]) -> int:
        """Copy the cached blocks that start `ids` into `rows` (each past input's row, [kv_heads,
        capacity, head_size]); returns how many tokens they hold. At least one token is left to
        prefill, whose logits choose the first new token."""
        with self._lock:
            blocks = self._match(ids)
        for i, found in enumerate(blocks):  # a stored block is never written again: no lock needed
            for name, row in rows.items():
                row[:, i * self.block:(i + 1) * self.block] = found.kv[name]
        return len(blocks) * self.block

    def take(self, ids: list[int]) -> tuple[int, dict[str, np.ndarray]]:
        """The cached blocks that start `ids`, joined: how many tokens, and each past input's keys
        or values of them [kv_heads, tokens, head_size] (a cache that grows from its past)."""
        with self._lock:
            blocks = self._match(ids)
        if not blocks:
            return 0, {}
        return len(blocks) * self.block, {name: np.concatenate([b.kv[name] for b in blocks], axis=1) for name in blocks[0].kv}

    def _match(self, ids: list[int]) -> list[_Block]:
        found, parent = [], 0
        while self.budget and (len(found) + 1) * self.block < len(ids):
            key = (parent, tuple(ids[len(found) * self.block:(len(found) + 1) * self.block]))
            block = self._blocks.get(key)
            if block is None:
                break
            self._blocks.move_to_end(key)
            found.append(block)
            parent = block.id
        self.hits += len(found) * self.block
        self.misses += len(ids) - len(found) * self.block
        return found

    def store(self, ids: list[int], rows: dict[str, np.ndarray]) -> None:
        """Keep the whole blocks of `ids`, whose keys and values `rows` now hold."""
        with self._lock:
            self._store(ids, rows)

    def _store(self, ids: list[int], rows: dict[str, np.ndarray]) -> None:
        parent = 0
        for start in range(0, len(ids) - self.block + 1, self.block) if self.budget else ():
            key = (parent, tuple(ids[start:start + self.block]))
            if key not in self._blocks:
                kv = {name: row[:, start:start + self.block].copy() for name, row in rows.items()}
                self._blocks[key] = _Block(self._next_id, kv)
                self._next_id += 1
                self.held += sum(a.nbytes for a in kv.values())
            self._blocks.move_to_end(key)
            parent = self._blocks[key].id
        while self.held > self.budget and self._blocks:
            _, dropped = self._blocks.popitem(last=False)
            self.held -= sum(a.nbytes for a in dropped.kv.values())
