"""The cache kinds (sdk/cache_kinds.py) of a hand-made hybrid layout, without a model: which kind
each layer's cache part is, and their answers to what the runner, the caches, the prefix cache and
the memory plan ask (buffers, padding, forgetting, blocks, bytes)."""

import numpy as np
import pytest

from edgeinfer.sdk.cache_kinds import FixedState, FullKV, WindowedKV, cache_kinds
from edgeinfer.sdk.errors import GenerationError
from edgeinfer.sdk.kv_cache import SlotCache
from edgeinfer.sdk.manifest import KVSpec

# Two attention layers (the first keeps a window of 8 tokens) and one linear-attention layer with
# a convolution state [6, 3] and a recurrent state [2, 4, 4].
SPEC = KVSpec(
    num_layers=2,
    num_kv_heads=2,
    head_size=4,
    dtype="float32",
    sequence_axis=2,
    past=[f"past_key_values.{i}.{part}" for i in (0, 2) for part in ("key", "value")],
    present=[f"present.{i}.{part}" for i in (0, 2) for part in ("key", "value")],
    state=[
        {"layer": 1, "kind": "conv", "past": "past_key_values.1.conv", "present": "present.1.conv", "shape": [6, 3]},
        {"layer": 1, "kind": "recurrent", "past": "past_key_values.1.recurrent", "present": "present.1.recurrent", "shape": [2, 4, 4]},
    ],
    windows=[8, -1],
)
DECLARED = {name: ["batch_size", 2, "past_sequence_length", 4] for name in SPEC.past}


def test_each_layer_part_is_its_kind():
    windowed, full, state = cache_kinds(SPEC, 64)
    assert (type(windowed), type(full), type(state)) == (WindowedKV, FullKV, FixedState)
    assert windowed.names == ("past_key_values.0.key", "past_key_values.0.value") and windowed.window == 8
    assert state.layer == 1 and state.names == ("past_key_values.1.conv", "past_key_values.1.recurrent")
    # what the readers ask: a padded batch prefill, forgetting by the books, the prefix cache's blocks
    assert [(k.pads, k.forgets, k.prefix) for k in (windowed, full, state)] == [
        (False, True, True),
        (True, True, True),
        (False, False, False),
    ]


def test_the_kinds_size_their_buffers():
    shapes = {}
    for kind in cache_kinds(SPEC, 64):
        shapes.update(kind.buffer_shapes(3, 64, DECLARED, SPEC.sequence_axis))
    assert shapes["past_key_values.0.key"] == [3, 2, 8, 4]  # the window and an eighth more, less one: 8 slots
    assert shapes["past_key_values.2.value"] == [3, 2, 64, 4]
    assert shapes["past_key_values.1.conv"] == [3, 6, 3] and shapes["past_key_values.1.recurrent"] == [3, 2, 4, 4]
    growing = {}
    for kind in cache_kinds(SPEC, 0):
        growing.update(kind.buffer_shapes(1, 0, DECLARED, SPEC.sequence_axis))
    assert growing["past_key_values.2.key"] == [1, 2, 0, 4] and growing["past_key_values.1.recurrent"] == [1, 2, 4, 4]


def test_the_kinds_count_their_bytes():
    windowed, full, state = cache_kinds(SPEC, 1024)
    assert [k.bytes_per_token(4) for k in (windowed, full, state)] == [0, 2 * (4 + 4) * 4, 0]
    # a window of 8 keeps 8 slots whatever the context
    assert windowed.bytes_per_row(1024, 4) == 2 * (4 + 4) * 8 * 4
    assert state.bytes_per_row(1024, 4) == (6 * 3 + 2 * 4 * 4) * 4 and full.bytes_per_row(1024, 4) == 0


def test_a_window_moves_once_its_buffer_is_full_and_a_state_moves_with_every_token():
    windowed, full, state = cache_kinds(SPEC, 64)
    slots = windowed.num_slots
    assert [windowed.held(t) for t in (3, slots, slots + 1)] == [3, slots, slots + 1 - (slots - 8 + 1)]
    assert not windowed.moves(slots - 1, 1) and windowed.moves(slots, 1)
    assert not full.moves(1000, 5) and state.moves(0, 1) and not state.moves(5, 0)


def test_a_state_is_zeroed_for_a_new_prompt_and_refuses_to_forget():
    kinds = cache_kinds(SPEC, 16)
    buffers = {name: np.ones([2, *entry["shape"]], np.float32) for entry in SPEC.state for name in [entry["past"]]}

    def write_row(buffer, row, values):
        buffer[row] = values

    kinds[2].reset_row(write_row, buffers, 1)
    assert all(not value[1].any() and value[0].all() for value in buffers.values())
    cache = SlotCache(SPEC, {}, 2, 16, kinds)
    cache.append([0], 3)
    assert [type(k) for k in cache.moving(0, 1)] == [FixedState] and cache.evicts
    with pytest.raises(GenerationError, match="recurrent state .* cannot take back"):
        cache.trim(0, 1)
    assert cache.trim(0, 1, state_put_back=True) == 1 and cache.lengths[0] == 2


def test_a_layout_whose_past_is_not_keys_and_values_per_layer_is_refused():
    from edgeinfer.sdk.errors import ManifestError

    with pytest.raises(ManifestError, match="3 past inputs for 2 layers"):
        KVSpec(2, 2, 4, "float32", 2, ["a", "b", "c"], ["d", "e", "f"])
