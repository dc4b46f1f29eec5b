"""The KV cache's bookkeeping on hand-made data, without a model or ONNX Runtime: padding, masks,
positions, prefill chunks, how present becomes past, and the capacity errors."""
import numpy as np
import pytest

from edgeinfer.sdk.errors import GenerationError
from edgeinfer.sdk.kv_cache import PAD_ID, InPlaceKVCache, KVCache
from edgeinfer.sdk.manifest import KVSpec

SPEC = KVSpec(num_layers=1, num_kv_heads=2, head_size=4, dtype="float32", sequence_axis=2,
              past=["past_key_values.0.key", "past_key_values.0.value"], present=["present.0.key", "present.0.value"])
SHAPES = {name: ["batch_size", 2, "past_sequence_length", 4] for name in SPEC.past}
P = PAD_ID


def lists(chunk: dict) -> tuple:
    return chunk["input_ids"].tolist(), chunk["attention_mask"].tolist(), chunk["position_ids"].tolist()


def buffers(shape, dtype):
    """An 'allocation' on the host, filled with a marker, standing in for the device buffer."""
    return np.full(shape, -1.0, np.dtype(dtype))


# The growing cache (optimum-onnx's attention): left-padded rows, presents become pasts.

def test_a_batch_is_left_padded_and_positions_count_each_rows_own_tokens():
    cache = KVCache(SPEC, SHAPES)
    (chunk,) = cache.prefill_chunks([[11, 12, 13], [21]], chunk=8)
    assert lists(chunk) == ([[11, 12, 13], [P, P, 21]], [[1, 1, 1], [0, 0, 1]], [[0, 1, 2], [0, 0, 0]])
    assert {name: v.shape for name, v in cache.past.items()} == {name: (2, 2, 0, 4) for name in SPEC.past}
    assert cache.length == 3


def test_prefill_chunks_cover_the_padded_width_and_the_mask_grows_with_them():
    cache = KVCache(SPEC, SHAPES)
    chunks = [lists(c) for c in cache.prefill_chunks([[11, 12, 13], [21]], chunk=2)]
    assert chunks == [([[11, 12], [P, P]], [[1, 1], [0, 0]], [[0, 1], [0, 0]]),
                      ([[13], [21]], [[1, 1, 1], [0, 0, 1]], [[2], [0]])]


def test_decode_appends_one_slot_per_row_and_takes_the_presents_as_the_next_past():
    cache = KVCache(SPEC, SHAPES)
    list(cache.prefill_chunks([[11, 12, 13], [21]], chunk=8))
    step = cache.decode_inputs([5, 6])
    assert lists(step) == ([[5], [6]], [[1, 1, 1, 1], [0, 0, 1, 1]], [[3], [1]])
    assert cache.keep == SPEC.present and cache.into == {}
    key, value = np.ones((2, 2, 4, 4), np.float32), np.zeros((2, 2, 4, 4), np.float32)
    cache.update({"present.0.key": key, "present.0.value": value, "logits": None})
    assert cache.past["past_key_values.0.key"] is key and cache.past["past_key_values.0.value"] is value


# The in-place cache (GroupQueryAttention): one buffer per past, right-padded rows.

def test_the_in_place_cache_allocates_one_buffer_per_past_and_binds_it_as_the_present():
    cache = InPlaceKVCache(SPEC, SHAPES, capacity=6, allocate=buffers)
    (chunk,) = cache.prefill_chunks([[11, 12, 13], [21]], chunk=8)
    assert lists(chunk) == ([[11, 12, 13], [21, P, P]], [[1, 1, 1], [1, 0, 0]], [[0, 1, 2], [0, 1, 2]])
    assert {name: v.shape for name, v in cache.past.items()} == {name: (2, 2, 6, 4) for name in SPEC.past}
    assert all(cache.into[present] is cache.past[past] for past, present in zip(SPEC.past, SPEC.present))
    assert cache.keep == [] and cache.lengths.tolist() == [3, 1]


def test_in_place_decode_writes_each_row_after_its_own_tokens():
    cache = InPlaceKVCache(SPEC, SHAPES, capacity=6, allocate=buffers)
    list(cache.prefill_chunks([[11, 12, 13], [21]], chunk=8))
    assert lists(cache.decode_inputs([5, 6])) == ([[5], [6]], [[1, 1, 1, 1], [1, 1, 0, 0]], [[3], [1]])
    assert cache.lengths.tolist() == [4, 2] and cache.length == 4
    before = dict(cache.past)
    cache.update({})
    assert cache.past == before  # the graph wrote into the buffers: nothing is handed over


def test_a_single_prompt_is_prefilled_in_chunks_on_the_slots_filled_before():
    cache = InPlaceKVCache(SPEC, SHAPES, capacity=12, allocate=buffers)
    chunks = [lists(c) for c in cache.prefill_chunks([list(range(1, 11))], chunk=4)]
    assert [ids for ids, _, _ in chunks] == [[[1, 2, 3, 4]], [[5, 6, 7, 8]], [[9, 10]]]
    assert [mask for _, mask, _ in chunks] == [[[1] * 4], [[1] * 8], [[1] * 10]]
    assert [positions for _, _, positions in chunks] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8, 9]]]


def test_an_in_place_batch_is_prefilled_in_one_pass_whatever_the_chunk():
    """GroupQueryAttention takes several tokens per row only on an empty cache when batch > 1."""
    cache = InPlaceKVCache(SPEC, SHAPES, capacity=8, allocate=buffers)
    chunks = [lists(c) for c in cache.prefill_chunks([[1, 2, 3, 4, 5, 6], [11, 12, 13, 14]], chunk=2)]
    assert chunks == [([[1, 2, 3, 4, 5, 6], [11, 12, 13, 14, P, P]], [[1] * 6, [1, 1, 1, 1, 0, 0]], [list(range(6))] * 2)]
    assert cache.lengths.tolist() == [6, 4]


def test_a_prompt_wider_than_the_capacity_is_refused_before_anything_is_allocated():
    allocated = []
    cache = InPlaceKVCache(SPEC, SHAPES, capacity=6, allocate=lambda shape, dtype: allocated.append(shape))
    with pytest.raises(GenerationError, match="a prompt of 7 tokens does not fit a cache of 6 slots: make the cache with a larger capacity"):
        list(cache.prefill_chunks([[1] * 7, [2]], chunk=8))
    assert allocated == []


def test_decoding_past_the_capacity_is_refused():
    cache = InPlaceKVCache(SPEC, SHAPES, capacity=4, allocate=buffers)
    list(cache.prefill_chunks([[1, 2, 3]], chunk=8))
    cache.decode_inputs([4])
    with pytest.raises(GenerationError, match="the cache's 4 slots are full: make the cache with a larger capacity"):
        cache.decode_inputs([5])
