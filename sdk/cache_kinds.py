"""Cache kinds: what each layer keeps between passes, one object per layer, so that the readers
(runner, kv_cache, prefix_cache, memory, prepare, scheduler) ask the kind instead of branching
on the manifest's flags.

- `FullKV`: an attention layer's keys and values of every token: two buffers along the sequence.
- `WindowedKV`: a sliding layer's keys and values where the buffer keeps only its window
  (GroupQueryAttention's `sliding_window_cache`: `window_capacity` slots, the latest positions
  from slot 0, the oldest evicted several at a time: `resident`).
- `FixedState`: a layer's fixed-size state, whatever the token count: a causal convolution's last
  inputs, and a recurrent state (linear attention's delta rule, a Mamba-2 layer's state-space
  scan, both run by LinearAttention). The manifest's `kv.state` lists its tensors. One class for
  the convolution, delta-rule and state-space states: they answer every question alike (a state
  reads padding as tokens, cannot forget a token, is kept whole per row).

A hybrid layer may have two kinds (Falcon-H1's attention beside its Mamba-2 mixer): kinds are
listed by the cache parts a layer has, attention first.
"""

from __future__ import annotations

import numpy as np

from .errors import GenerationError
from .manifest import KVSpec


class FullKV:
    """Keys and values of every token the row holds."""

    pads = True  # rows left- or right-padded to one length may share a prefill pass
    forgets = True  # the books alone take back the last tokens (the next pass writes over them)
    prefix = True  # the prefix cache may keep its blocks
    may_move = False  # whether `moves` can ever answer True (what a pass's idle rows ask)

    def __init__(self, layer: int, names: tuple[str, str], heads: int, key: int, value: int):
        self.layer, self.names, self.heads, self.key, self.value = layer, names, heads, key, value

    def slots(self, capacity: int) -> int:
        """Slots per row of its buffers in a cache of `capacity` tokens per row."""
        return capacity

    def held(self, tokens: int) -> int:
        """How many of a row's latest positions its buffers hold once the row has read `tokens`."""
        return tokens

    def moves(self, tokens: int, count: int) -> bool:
        """Whether `count` more tokens (fewer, where negative) on a row holding `tokens` change
        what the buffers hold beyond the books (then the row cannot simply forget them again)."""
        return False

    def buffer_shapes(self, rows: int, capacity: int, declared: dict, axis: int) -> dict[str, list[int]]:
        """Each of its buffers' shape for `rows` rows of `capacity` tokens (0: a past that grows
        from nothing), from the graph's `declared` input shapes, `axis` the sequence's."""
        slots = self.slots(capacity)
        return {
            name: [slots if k == axis else (dim if isinstance(dim, int) else rows) for k, dim in enumerate(declared[name])]
            for name in self.names
        }

    def reset_row(self, write_row, buffers: dict, row: int) -> None:
        """Make the row's buffers as a new prompt starts from them: the books alone say it is empty."""

    def bytes_per_token(self, itemsize: int) -> int:
        return self.heads * (self.key + self.value) * itemsize

    def bytes_per_row(self, context: int, itemsize: int) -> int:
        """Bytes one row holds whatever its length (besides `bytes_per_token` for each token)."""
        return 0


class WindowedKV(FullKV):
    """A sliding layer's keys and values in a buffer of the latest window."""

    pads = False  # GroupQueryAttention refuses padding in a pass over a windowed cache
    may_move = True

    def __init__(self, layer: int, names: tuple[str, str], heads: int, key: int, value: int, window: int, capacity: int, exact: bool):
        """In a cache of `capacity` tokens per row; `exact`: the buffer holds the window exactly
        (CUDA's op takes no more)."""
        super().__init__(layer, names, heads, key, value)
        self.window, self.exact = window, exact
        self.num_slots = self.slots(capacity)

    def slots(self, capacity: int) -> int:
        return window_capacity(self.window, capacity, self.exact) if capacity else 0

    def held(self, tokens: int) -> int:
        return resident(tokens, self.num_slots, self.window)

    def moves(self, tokens: int, count: int) -> bool:
        return self.held(tokens + count) != self.held(tokens) + count

    def bytes_per_token(self, itemsize: int) -> int:
        return 0

    def bytes_per_row(self, context: int, itemsize: int) -> int:
        return self.heads * (self.key + self.value) * self.slots(context) * itemsize


class FixedState:
    """A layer's states of fixed size: {past input: shape after the rows axis}."""

    pads = False  # a state reads a pass's padding as tokens: each row alone
    forgets = False  # a state holds every token it read in one tensor: none can be taken back
    prefix = False  # a block of tokens would need the state at its end
    may_move = True

    def __init__(self, layer: int, shapes: dict[str, list[int]], dtype: str):
        self.layer, self.shapes, self.dtype = layer, shapes, np.dtype(dtype)
        self.names = tuple(shapes)

    def slots(self, capacity: int) -> None:
        return None

    def buffer_shapes(self, rows: int, capacity: int, declared: dict, axis: int) -> dict[str, list[int]]:
        return {name: [rows, *shape] for name, shape in self.shapes.items()}

    def held(self, tokens: int) -> int:
        return tokens

    def moves(self, tokens: int, count: int) -> bool:
        return count != 0

    def reset_row(self, write_row, buffers: dict, row: int) -> None:
        """Zero the row's state, as a new prompt starts from it."""
        for name, shape in self.shapes.items():
            write_row(buffers[name], row, np.zeros(shape, self.dtype))

    def bytes_per_token(self, itemsize: int) -> int:
        return 0

    def bytes_per_row(self, context: int, itemsize: int) -> int:
        return sum(int(np.prod(shape)) for shape in self.shapes.values()) * itemsize


CacheKind = FullKV | WindowedKV | FixedState


def cache_kinds(spec: KVSpec, capacity: int, exact_windows: bool = False) -> list[CacheKind]:
    """The kind of each layer's cache part in a cache of `capacity` tokens per row: the attention
    layers' (in the order of `spec.past`), then the fixed-size states (in the order of
    `spec.state`). `exact_windows`: a windowed buffer holds its window exactly (CUDA)."""
    kinds: list[CacheKind] = []
    for index, (heads, key, value) in enumerate(spec.layer_shapes()):
        names = (spec.past[2 * index], spec.past[2 * index + 1])
        window = spec.windows[index] if spec.windows else -1
        if window > 0:
            kinds.append(WindowedKV(index, names, heads, key, value, window, capacity, exact_windows))
        else:
            kinds.append(FullKV(index, names, heads, key, value))
    layers: dict[int, dict] = {}
    for entry in spec.state:
        layers.setdefault(entry.get("layer", len(layers)), {})[entry["past"]] = entry["shape"]
    kinds += [FixedState(layer, shapes, spec.dtype) for layer, shapes in layers.items()]
    return kinds


def evicting(kinds: list[CacheKind]) -> dict:
    """`held` of each buffer whose layer keeps only its window: name -> positions it holds after n tokens."""
    return {name: kind.held for kind in kinds if isinstance(kind, WindowedKV) for name in kind.names}


def refuse_forgetting(kinds: list[CacheKind]) -> None:
    """Refused where a layer cannot take back tokens it has read (a fixed-size state)."""
    if any(not kind.forgets for kind in kinds):
        raise GenerationError(
            "this model keeps a recurrent state (linear attention or a state-space mixer), which cannot take back "
            "tokens it has read, as speculative decoding does with a rejected draft: generate without speculative decoding"
        )


def window_capacity(window: int, capacity: int, exact: bool = False) -> int:
    """Slots of the buffer of a layer that keeps its `window`, in a cache of `capacity` slots per
    row: the window and an eighth more, so that the op evicts an eighth of a window at once instead
    of one position a pass; only the window where the op takes no more (`exact`: CUDA). At least
    the window (the op's floor), at most what the rows hold."""
    return window if exact else max(window, min(capacity, window + max(1, window // 8) - 1))


def resident(tokens: int, slots: int, window: int) -> int:
    """How many of a row's latest positions a windowed buffer of `slots` holds once the row has
    read `tokens` (GroupQueryAttention's rule): all of them up to `slots`; past it, the op evicts
    `slots - window + 1` at a time, so never fewer than the window."""
    if tokens <= slots:
        return tokens
    at_once = slots - window + 1
    return tokens - at_once * -(-(tokens - slots) // at_once)
