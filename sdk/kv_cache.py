"""The KV caches: the buffers that hold the past keys and values, and the books of which slots
hold tokens. They build no graph inputs: the runner (runner.py) reads their books to build them.

Both kinds speak one protocol: `lengths` (tokens each row holds), `capacity` (slots per row, None
where the past grows), `append`, `trim`, `buffers` (each past input's value) and `nbytes`.
- `GrowingCache`: a graph whose attention returns a longer present each pass (optimum-onnx's
  attention). Rows are left-padded to one `width`; each pass's presents become the past (`take`).
- `SlotCache`: a graph whose attention writes into its past (`kv.in_place`). One buffer per past
  input, [rows, kv_heads, capacity, head_size], allocated once and written in place; rows are
  right-padded (a row's tokens fill its slots from 0) and handed out and taken back (`acquire`,
  `release`), so one cache serves a generation's batch or a scheduler's many requests.

What each layer's part of the cache is (every token's keys and values, a window of them, a
fixed-size state) is its kind (cache_kinds.py), which the caches ask; the books count every token
a row holds (its positions), whatever the layers' buffers keep of them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .cache_kinds import CacheKind, cache_kinds, evicting, refuse_forgetting
from .errors import GenerationError
from .manifest import KVSpec

PAD_ID = 0  # fed where a row has no token: padding, and rows that are not decoding


class KVCache(Protocol):
    lengths: np.ndarray  # [rows] tokens each row holds
    capacity: int | None  # slots per row; None: the past grows pass by pass
    buffers: dict  # each past input's keys or values

    def append(self, rows: list[int], count: int = 1) -> None: ...

    def trim(self, row: int, count: int) -> int: ...

    @property
    def nbytes(self) -> int: ...


class GrowingCache:
    """The past of a graph that returns it one pass longer, left-padded: row r's tokens are the
    last `lengths[r]` of `width` slots."""

    capacity = None

    def __init__(self, spec: KVSpec, buffers: dict, lengths: list[int]):
        """`buffers`: each past input's value before the first pass (zero tokens, or the prefix
        cache's blocks of a single prompt); `lengths`: the tokens they hold per row."""
        self.spec, self.buffers, self.kinds = spec, buffers, cache_kinds(spec, 0)
        self._movable = [kind for kind in self.kinds if kind.may_move]
        self.lengths = np.array(lengths, np.int64)
        self.width = int(self.lengths.max(initial=0))
        # per row, its next token's rotary position less its count of tokens: 0 but where a
        # picture placed by rows and columns took fewer positions than tokens (sdk/vision.py)
        self.shifts = np.zeros(len(lengths), np.int64)

    def append(self, rows: list[int] | None = None, count: int = 1) -> None:
        """`count` more slots for every row (the past is one array: every row grows)."""
        self.width += count
        self.lengths += count

    def fill(self, width: int, lengths: np.ndarray) -> None:
        """After a prefill chunk: `width` slots per row, the last `lengths[r]` of them row r's tokens."""
        self.width, self.lengths = width, lengths

    def take(self, presents: dict) -> None:
        """A pass's present outputs (keys and values, and any recurrent state) become the past of the next pass."""
        self.buffers = {past: presents[present] for past, present in cache_pairs(self.spec)}

    def moving(self, row: int, count: int) -> list[CacheKind]:
        """As SlotCache.moving: the kinds that `count` more tokens change beyond the books (a state)."""
        return [kind for kind in self._movable if kind.moves(int(self.lengths[row]), count)]

    def trim(self, row: int, count: int) -> int:
        """Forget the last `count` tokens of the single row (a copy through the host); returns how many."""
        if count <= 0:
            return 0
        refuse_forgetting(self.kinds)
        if len(self.lengths) != 1:
            raise GenerationError(
                "this export keeps the attention as traced, whose cache forgets tokens for one prompt at "
                "a time: generate the prompts one by one"
            )
        self.width -= count
        self.lengths -= count
        cut = (slice(None),) * self.spec.sequence_axis + (slice(0, self.width),)
        self.buffers = {name: np.ascontiguousarray(host_array(value)[cut]) for name, value in self.buffers.items()}
        return count

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(value) for value in self.buffers.values())


class SlotCache:
    """Buffers written in place, one row (a slot) per generation: `acquire` hands out the lowest
    free row, `release` takes it back; `lengths` says how many tokens each row holds."""

    def __init__(self, spec: KVSpec, buffers: dict, num_rows: int, capacity: int, kinds: list[CacheKind] | None = None):
        """`kinds`: each layer's (cache_kinds.cache_kinds for this capacity, where not given)."""
        self.spec, self.buffers, self.num_rows, self.capacity = spec, buffers, num_rows, capacity
        self.kinds = kinds if kinds is not None else cache_kinds(spec, capacity)
        self._movable = [kind for kind in self.kinds if kind.may_move]  # asked for each idle row of each pass
        self.held = evicting(self.kinds)  # what each windowed buffer holds after n tokens (the prefix cache asks)
        self.lengths = np.zeros(self.num_rows, np.int64)
        self.shifts = np.zeros(self.num_rows, np.int64)  # as GrowingCache.shifts
        self._free = list(range(self.num_rows))

    def acquire(self) -> int | None:
        """The lowest free row (decode passes cover the rows up to the highest one in use), or None."""
        if not self._free:
            return None
        self._free.sort()
        return self._free.pop(0)

    def release(self, row: int) -> None:
        self.lengths[row] = self.shifts[row] = 0
        self._free.append(row)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def append(self, rows: list[int], count: int = 1) -> None:
        """`count` more tokens in each of `rows`; refused past the capacity."""
        for row in rows:
            if self.lengths[row] + count > self.capacity:
                raise GenerationError(
                    f"a row of {self.lengths[row] + count} tokens does not fit the cache's {self.capacity} "
                    "slots per row: make the cache with a larger capacity"
                )
        self.lengths[rows] += count

    def trim(self, row: int, count: int, state_put_back: bool = False) -> int:
        """Forget the row's last `count` tokens (the next pass writes over them); returns how many.
        A recurrent state cannot forget tokens: refused unless the caller puts the row's state
        back as it was before them (`state_put_back`, runner.take_back)."""
        count = max(0, min(count, int(self.lengths[row])))
        if count and not state_put_back:
            refuse_forgetting(self.kinds)
            if self.moving(row, -count):
                raise GenerationError(
                    f"the last {count} tokens of row {row} moved a sliding layer's window, which cannot take them "
                    "back: put the row's buffers back as they were before them (runner.row_state) first"
                )
        self.lengths[row] -= count
        return count

    def moving(self, row: int, count: int) -> list[CacheKind]:
        """The kinds whose buffers `count` more tokens on the row (fewer, where negative) change
        beyond the books (a state reads them, a window evicts): then the row's buffers cannot
        simply forget them again."""
        tokens = int(self.lengths[row])
        return [kind for kind in self._movable if kind.moves(tokens, count)]

    @property
    def evicts(self) -> bool:
        """Whether a layer keeps only its window: a prompt's blocks are kept while it holds them."""
        return bool(self.held)

    @property
    def pooled(self) -> dict:
        """Each past input's buffer with the present output written into it (a recurrent state too)."""
        return {past: (self.buffers[past], present) for past, present in cache_pairs(self.spec)}

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(value) for value in self.buffers.values())


def cache_pairs(spec: KVSpec) -> list[tuple[str, str]]:
    """(past input, present output) of every cache tensor: keys and values, then recurrent states."""
    return [*zip(spec.past, spec.present), *((entry["past"], entry["present"]) for entry in spec.state)]


def host_array(value) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else value.numpy()


def _nbytes(value) -> int:
    """Bytes of a numpy array or an OrtValue (float32 or a 16-bit type)."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    return int(np.prod(value.shape())) * (2 if "16" in value.data_type() else 4)
