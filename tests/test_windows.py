"""Sliding layers whose cache keeps only their window (GroupQueryAttention's `sliding_window_cache`):
the op keeps a row's latest positions from slot 0 of a buffer a little larger than the window and
evicts the oldest several at a time. A tiny EXAONE 4 (one sliding layer of window 16, one full
layer) against transformers with prompts and generations well past the window: alone, in a batch,
in chunks, in the scheduler's continuous batching, with speculative decoding and with the prefix
cache; on the CPU's buffers and on CUDA's (exactly the window, so every pass past it evicts)."""

import pytest
from architectures import WINDOW
from conftest import export_tiny, scheduled_and_alone
from test_cli import edgeinfer

from edgeinfer import Engine
from edgeinfer.export.validate import transformers_greedy
from edgeinfer.sdk.errors import GenerationError
from edgeinfer.sdk.cache_kinds import resident, window_capacity
from edgeinfer.sdk.manifest import WINDOWS_FORMAT_VERSION
from edgeinfer.sdk.memory import MemoryPlan

PROMPTS = [list(range(3, 43)), [5, 6, 7], list(range(100, 119)), [9] * 11]
SLOTS = WINDOW + WINDOW // 8 - 1  # the CPU's buffer of a 16-token window: 17 slots, 2 evicted at once


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    return export_tiny("exaone4", tmp_path_factory.mktemp("exaone4"))


def engine_of(folder, exact: bool, **options) -> Engine:
    """An engine whose windowed buffers are the CPU's, or CUDA's (`exact`: the window alone)."""
    engine = Engine.load(folder, provider="cpu", **options)
    engine.runner.exact_windows = exact
    return engine


def test_the_resident_positions_follow_the_ops_rule():
    assert [resident(t, SLOTS, WINDOW) for t in (1, 16, 17, 18, 19, 20, 21)] == [1, 16, 17, 16, 17, 16, 17]
    assert [resident(t, WINDOW, WINDOW) for t in (15, 16, 17, 100)] == [15, 16, 16, 16]  # CUDA: one at a time
    assert window_capacity(WINDOW, 1024) == SLOTS and window_capacity(WINDOW, 1024, exact=True) == WINDOW
    assert window_capacity(4096, 131072) == 4096 + 511 and window_capacity(WINDOW, 8) == WINDOW  # never under the window


def test_the_manifest_names_the_window_and_the_plan_counts_it_once_per_row(windowed, tmp_path):
    engine = Engine.load(windowed[1], provider="cpu")
    manifest = engine.manifest
    assert manifest.kv.windows == [WINDOW, -1] and manifest.format_version == WINDOWS_FORMAT_VERSION
    batch = engine.runner.new_batch(2, 64)
    slots = [batch.cache.buffers[name].shape()[2] for name in manifest.kv.past]
    assert slots == [SLOTS, SLOTS, 64, 64]
    per_layer = 2 * manifest.kv.num_kv_heads * manifest.kv.head_size * 4  # keys and values, fp32
    plan = MemoryPlan.of(manifest, 64, 2)
    assert (plan.kv_per_token, plan.state_per_row) == (per_layer, per_layer * SLOTS)
    assert plan.kv == (per_layer * 64 + per_layer * SLOTS) * 2
    done = edgeinfer("export", str(windowed[1].parent / "hf"), "-o", str(tmp_path / "again"))
    assert done.returncode == 0, done.stderr
    assert "(exaone4, 2 layers, 1 of them keeping only their 16-token window)" in done.stdout + done.stderr  # its last line


@pytest.mark.parametrize("exact", [False, True], ids=["cpu-slots", "cuda-slots"])
def test_generation_equals_transformers_alone_in_a_batch_and_in_chunks(windowed, exact):
    model, folder = windowed
    expected = [transformers_greedy(model, p, 24) for p in PROMPTS]
    engine = engine_of(folder, exact)
    assert [engine.generate(p, max_new_tokens=24, ignore_eos=True).token_ids for p in PROMPTS] == expected
    assert [r.token_ids for r in engine.generate_batch(PROMPTS, max_new_tokens=24, ignore_eos=True)] == expected
    chunked = engine_of(folder, exact, prefill_chunk=6, prefix_cache=0)  # chunks that evict on the way
    assert chunked.generate(PROMPTS[0], max_new_tokens=24, ignore_eos=True).token_ids == expected[0]


@pytest.mark.parametrize("exact", [False, True], ids=["cpu-slots", "cuda-slots"])
def test_rows_joining_and_leaving_a_running_batch_each_get_what_they_get_alone(windowed, exact):
    """A decode pass writes a pad token into each row not decoding; where that moves the row's
    window, the row's buffers are put back as they were (runner.decode)."""
    scheduled, alone = scheduled_and_alone(engine_of(windowed[1], exact, prefill_chunk=5, prefix_cache=0), PROMPTS)
    assert scheduled == alone


@pytest.mark.parametrize("exact", [False, True], ids=["cpu-slots", "cuda-slots"])
def test_speculative_decoding_puts_a_moved_window_back(windowed, exact):
    """A window cannot take back what it evicted for a rejected proposal: the row's buffers are
    put back and the kept tokens run again (runner.take_back); greedy tokens are plain decoding's."""
    engine = engine_of(windowed[1], exact, prefix_cache=0)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9] * 11, [100, 101, 102, 9, 100, 101, 102], list(range(3, 40))]
    plain = [engine.generate(p, max_new_tokens=40, ignore_eos=True).token_ids for p in prompts]
    fast = [engine.generate(p, max_new_tokens=40, ignore_eos=True, speculative="prompt_lookup") for p in prompts]
    assert [r.token_ids for r in fast] == plain
    assert any(r.proposed_tokens > r.accepted_tokens for r in fast)  # proposals were rejected past the window
    batch = engine.generate_batch(prompts, max_new_tokens=40, ignore_eos=True, speculative="prompt_lookup")
    assert [r.token_ids for r in batch] == plain


def test_a_cache_refuses_to_forget_tokens_that_moved_its_window(windowed):
    engine = Engine.load(windowed[1], provider="cpu", prefix_cache=0)
    batch = engine.runner.new_batch(1, 64)
    engine.runner.prefill(batch, [list(range(3, 3 + SLOTS))])  # 17 tokens: the buffer is full
    assert not batch.cache.moving(0, -1)
    engine.runner.decode(batch, [50])  # the 18th evicts two
    assert batch.cache.moving(0, -1)
    with pytest.raises(GenerationError, match="moved a sliding layer's window"):
        batch.cache.trim(0, 1)


@pytest.mark.parametrize("exact", [False, True], ids=["cpu-slots", "cuda-slots"])
def test_the_prefix_cache_fills_a_window_from_the_blocks_that_kept_it(windowed, exact):
    """Blocks keep a windowed layer's part while its buffer holds them (stored after each chunk):
    a prompt that starts like a stored one takes the blocks whose ends its window can be filled
    at, and its tokens are transformers'."""
    model, folder = windowed
    system = [(7 * i + 3) % 200 + 3 for i in range(64)]
    first, second, third = system + [11] * 30, system + list(range(20, 60)), system[:40] + [12] * 9
    engine = engine_of(folder, exact, prefill_chunk=8)
    engine.runner.prefix_cache.block = 8  # blocks shorter than the window (a real model's are 32, its window 512 or more)
    for prompt in (first, second, third):
        assert engine.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids == transformers_greedy(model, prompt, 12)
    prefix = engine.runner.prefix_cache
    assert prefix.hit_tokens == 64 + 40  # the system prompt's 8 blocks, then 5 of them
    blocks = list(prefix._blocks.values())
    assert all(set(b.kv) == set(engine.manifest.kv.past) for b in blocks)  # each kept while the window held it
    assert prefix.num_bytes == sum(a.nbytes for b in blocks for a in b.kv.values())


def test_a_prompt_takes_only_the_blocks_its_window_can_be_filled_from(windowed):
    """Chunks longer than the window leave blocks without the windowed layer's part (it was evicted
    before the chunk ended): a later prompt takes the most blocks whose end the window can be filled
    at, fewer than match."""
    model, folder = windowed
    engine = Engine.load(folder, provider="cpu", prefill_chunk=40)
    engine.runner.prefix_cache.block = 8
    first = [(7 * i + 3) % 200 + 3 for i in range(80)]
    second = first[:64] + [13] * 20
    for prompt in (first, second):
        assert engine.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids == transformers_greedy(model, prompt, 12)
    # stored at 40 and at 80 (16 positions each): blocks 3-4 and 8-9 have the window's part; of
    # the 8 blocks that match, the end of the 5th is the last whose window is there
    assert engine.runner.prefix_cache.hit_tokens == 40
