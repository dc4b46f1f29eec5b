"""The inputs of each pass, from the caches' books (kv_cache.py): `input_ids`, `attention_mask`,
`position_ids` and `logits_to_keep`. Pure functions of the books, which they bring up to date:
the runner calls them, the tests run them on hand-made caches."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .errors import GenerationError
from .kv_cache import PAD_ID, GrowingCache, SlotCache

LAST_ONLY = np.array(1, np.int64)  # `logits_to_keep` of a pass whose last position alone is read


def prepare_decode(cache: GrowingCache | SlotCache, tokens: list[int | None], is_static: bool = False) -> dict[str, np.ndarray]:
    """One new token for each row that has one (None: a pad token), on top of what each holds; the
    books grow by them. A growing cache's rows are left-padded (every row grows); a slot cache's
    rows are right-padded, and a static graph's mask spans the whole capacity."""
    ids = np.array([[PAD_ID if t is None else t] for t in tokens], np.int64)
    lengths = cache.lengths[: len(tokens)].copy()
    if isinstance(cache, GrowingCache):
        cache.append()
        mask = np.arange(cache.width)[None, :] >= cache.width - cache.lengths[:, None]
    else:
        cache.append([row for row, t in enumerate(tokens) if t is not None])
        mask = np.arange(cache.capacity if is_static else int(lengths.max()) + 1)[None, :] <= lengths[:, None]
    return {"input_ids": ids, "attention_mask": mask.astype(np.int64), "position_ids": lengths[:, None], "logits_to_keep": LAST_ONLY}


def prepare_row(cache: GrowingCache | SlotCache, row: int, tokens: list[int], is_static: bool = False) -> dict[str, np.ndarray]:
    """`tokens` on top of what `row` holds, for a pass on that row alone; its length grows by them.
    A growing cache serves it for a batch of one."""
    if isinstance(cache, GrowingCache) and len(cache.lengths) != 1:
        raise GenerationError(
            "this export keeps the attention as traced, whose cache serves speculative decoding for "
            "one prompt at a time: generate the prompts one by one"
        )
    start = int(cache.lengths[row])
    cache.append([row], len(tokens))
    end = start + len(tokens)
    width = cache.capacity if is_static and cache.capacity else end
    return {
        "input_ids": np.array([tokens], np.int64),
        "attention_mask": (np.arange(width) < end).astype(np.int64)[None, :],
        "position_ids": np.arange(start, end, dtype=np.int64)[None, :],
    }


def prepare_together(cache: SlotCache, prompts: list[list[int]], length: int, width: int) -> dict[str, np.ndarray]:
    """The first `length` tokens of every prompt into empty rows 0.. in one pass of `width`
    positions (right-padded); each row's length grows by its tokens."""
    ids = np.full((len(prompts), width), PAD_ID, np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, : min(len(prompt), width)] = prompt[:width]
    lengths = np.array([min(len(p), length) for p in prompts], np.int64)
    for row, count in enumerate(lengths):
        cache.append([row], int(count))
    return {
        "input_ids": ids,
        "attention_mask": (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64),
        "position_ids": np.tile(np.arange(width, dtype=np.int64), (len(prompts), 1)),
        "logits_to_keep": LAST_ONLY,
    }


def prepare_left_padded(
    cache: GrowingCache, prompts: list[list[int]], width: int, spans: Iterator[tuple[int, int]]
) -> Iterator[tuple[int, int, dict[str, np.ndarray]]]:
    """(start, end, inputs) of each prefill pass of prompts left-padded to `width` on a growing
    cache; the books are brought to each pass's end once it has run (at the next item)."""
    ids, mask = np.full((len(prompts), width), PAD_ID, np.int64), np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    positions = np.maximum(mask.cumsum(axis=1) - 1, 0)
    for start, end in spans:
        yield (
            start,
            end,
            {
                "input_ids": ids[:, start:end],
                "attention_mask": mask[:, :end],
                "position_ids": positions[:, start:end],
                "logits_to_keep": LAST_ONLY,
            },
        )
        cache.fill(end, mask[:, :end].sum(axis=1))
