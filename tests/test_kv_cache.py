"""The KV caches' books and the inputs the runner builds from them, on hand-made data without a
model or ONNX Runtime: padding, masks, positions, prefill passes, rows handed out and taken back,
trimming, and the capacity errors."""

import numpy as np
import pytest

from edgeinfer.sdk.errors import GenerationError
from edgeinfer.sdk.kv_cache import PAD_ID, GrowingCache, SlotCache
from edgeinfer.sdk.manifest import KVSpec
from edgeinfer.sdk.inputs import prepare_decode, prepare_left_padded, prepare_row, prepare_together

SPEC = KVSpec(
    num_layers=1,
    num_kv_heads=2,
    head_size=4,
    dtype="float32",
    sequence_axis=2,
    past=["past_key_values.0.key", "past_key_values.0.value"],
    present=["present.0.key", "present.0.value"],
)
P = PAD_ID


def lists(inputs: dict) -> tuple:
    return inputs["input_ids"].tolist(), inputs["attention_mask"].tolist(), inputs["position_ids"].tolist()


def spans(width, chunk):
    return [(start, min(start + chunk, width)) for start in range(0, width, chunk)]


# The growing cache (the attention as traced): left-padded rows, presents become pasts.


def test_a_batch_is_left_padded_and_positions_count_each_rows_own_tokens():
    cache = GrowingCache(SPEC, {}, [0, 0])
    ((_, _, inputs),) = list(prepare_left_padded(cache, [[11, 12, 13], [21]], 3, spans(3, 8)))
    assert lists(inputs) == ([[11, 12, 13], [P, P, 21]], [[1, 1, 1], [0, 0, 1]], [[0, 1, 2], [0, 0, 0]])
    assert (cache.width, cache.lengths.tolist()) == (3, [3, 1])


def test_prefill_passes_cover_the_padded_width_and_the_mask_grows_with_them():
    cache = GrowingCache(SPEC, {}, [0, 0])
    passes = [lists(inputs) for _, _, inputs in prepare_left_padded(cache, [[11, 12, 13], [21]], 3, spans(3, 2))]
    assert passes == [([[11, 12], [P, P]], [[1, 1], [0, 0]], [[0, 1], [0, 0]]), ([[13], [21]], [[1, 1, 1], [0, 0, 1]], [[2], [0]])]


def test_decode_appends_one_slot_per_row_and_takes_the_presents_as_the_next_past():
    cache = GrowingCache(SPEC, {}, [0, 0])
    list(prepare_left_padded(cache, [[11, 12, 13], [21]], 3, spans(3, 8)))
    assert lists(prepare_decode(cache, [5, 6])) == ([[5], [6]], [[1, 1, 1, 1], [0, 0, 1, 1]], [[3], [1]])
    key, value = np.ones((2, 2, 4, 4), np.float32), np.zeros((2, 2, 4, 4), np.float32)
    cache.take({"present.0.key": key, "present.0.value": value, "logits": None})
    assert cache.buffers["past_key_values.0.key"] is key and cache.buffers["past_key_values.0.value"] is value


def test_a_growing_cache_trims_its_single_row_and_refuses_a_batch():
    cache = GrowingCache(SPEC, {name: np.zeros((1, 2, 7, 4), np.float32) for name in SPEC.past}, [5])
    assert lists(prepare_row(cache, 0, [7, 8])) == ([[7, 8]], [[1] * 7], [[5, 6]])
    assert cache.trim(0, 3) == 3 and (cache.width, cache.lengths.tolist()) == (4, [4])
    assert all(v.shape == (1, 2, 4, 4) for v in cache.buffers.values())
    with pytest.raises(GenerationError, match="one prompt at a time"):
        GrowingCache(SPEC, {}, [2, 2]).trim(0, 1)


# The slot cache (GroupQueryAttention): buffers written in place, right-padded rows.


def slots(num_rows, capacity):
    return SlotCache(SPEC, {name: np.zeros((num_rows, 2, capacity, 4), np.float32) for name in SPEC.past}, num_rows, capacity)


def test_a_batch_prefilled_together_is_right_padded():
    cache = slots(2, 6)
    inputs = prepare_together(cache, [[11, 12, 13], [21]], 3, 3)
    assert lists(inputs) == ([[11, 12, 13], [21, P, P]], [[1, 1, 1], [1, 0, 0]], [[0, 1, 2], [0, 1, 2]])
    assert cache.lengths.tolist() == [3, 1]


def test_decode_writes_each_row_after_its_own_tokens_and_a_row_without_a_token_keeps_its_length():
    cache = slots(3, 6)
    prepare_together(cache, [[11, 12, 13], [21], [31, 32]], 3, 3)
    assert lists(prepare_decode(cache, [5, 6, None])) == ([[5], [6], [P]], [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], [[3], [1], [2]])
    assert cache.lengths.tolist() == [4, 2, 2]
    assert prepare_decode(cache, [7], is_static=True)["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0]]


def test_a_prompt_goes_into_its_row_chunk_by_chunk_on_the_slots_filled_before():
    cache = slots(2, 12)
    row = cache.acquire()
    ids = list(range(1, 11))
    passes = [lists(prepare_row(cache, row, ids[start:end])) for start, end in spans(10, 4)]
    assert [ids for ids, _, _ in passes] == [[[1, 2, 3, 4]], [[5, 6, 7, 8]], [[9, 10]]]
    assert [mask for _, mask, _ in passes] == [[[1] * 4], [[1] * 8], [[1] * 10]]
    assert [positions for _, _, positions in passes] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8, 9]]]
    assert cache.lengths.tolist() == [10, 0]


def test_rows_are_handed_out_lowest_first_and_taken_back_empty():
    cache = slots(3, 4)
    assert [cache.acquire() for _ in range(3)] + [cache.acquire()] == [0, 1, 2, None]
    cache.append([1], 3)
    cache.release(1)
    assert (cache.num_free, cache.lengths.tolist(), cache.acquire()) == (1, [0, 0, 0], 1)


def test_trimming_forgets_a_rows_last_tokens_and_never_more_than_it_holds():
    cache = slots(1, 8)
    assert cache.nbytes == 2 * 1 * 2 * 8 * 4 * 4  # two float32 buffers [1, 2, 8, 4], whatever the rows hold
    cache.append([0], 5)
    assert cache.trim(0, 2) == 2 and cache.trim(0, 10) == 3 and cache.lengths.tolist() == [0]


def test_a_row_past_the_capacity_is_refused():
    cache = slots(1, 4)
    prepare_row(cache, 0, [1, 2, 3])
    prepare_decode(cache, [4])
    with pytest.raises(
        GenerationError, match="a row of 5 tokens does not fit the cache's 4 slots per row: make the cache with a larger capacity"
    ):
        prepare_decode(cache, [5])
