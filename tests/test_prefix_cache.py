"""The prefix cache: a prompt that starts like an earlier one prefills only the rest, and every
logit and token equals what the same engine gives with the cache off."""

import numpy as np
import pytest
from conftest import count_graph_runs

from edgeinfer import Engine, Scheduler

SYSTEM = [(11 * i) % 300 + 3 for i in range(150)]  # a long shared start: 4 whole blocks of 32 and part of a fifth
QUESTIONS = [[40, 41, 42], [50, 51, 52, 53, 54], [60]]


@pytest.fixture(scope="module")
def exports(tiny_llama, tmp_path_factory):
    """The tiny llama with its cache written in place, and without the rewrite (optimum-onnx's
    attention: a cache that grows from its past)."""
    from edgeinfer.export import ExportOptions, export_model

    growing = tmp_path_factory.mktemp("growing") / "export"
    export_model(str(tiny_llama[0]), growing, ExportOptions(fuse=False))
    return {"in place": tiny_llama[1], "growing": growing}


@pytest.fixture(scope="module", params=["in place", "growing"])
def engines(exports, request):
    cached, plain = (Engine.load(exports[request.param], provider="cpu", prefix_cache=budget) for budget in (16, 0))
    assert cached.manifest.kv.in_place == (request.param == "in place")
    return cached, plain


def prefill_logits(engine, ids):
    cache = engine.runner.new_batch(1, len(ids) + 1)
    return engine.runner.prefill(cache, [ids]).numpy()


def test_prompts_that_share_a_start_reuse_it_with_the_same_logits_and_tokens(engines):
    cached, plain = engines
    assert cached.prefix_cache.budget == 16 * 2**20 and plain.prefix_cache.budget == 0
    cached.generate(SYSTEM + [99], max_new_tokens=1)  # the first prompt: prefilled whole, its blocks kept
    for question in QUESTIONS:
        before = cached.prefix_cache.hit_tokens
        ids = SYSTEM + question
        np.testing.assert_array_equal(prefill_logits(cached, ids), prefill_logits(plain, ids))
        assert cached.prefix_cache.hit_tokens - before == 128  # the 4 whole blocks of the shared start
        greedy = cached.generate(ids, max_new_tokens=12, ignore_eos=True)
        assert greedy.token_ids == plain.generate(ids, max_new_tokens=12, ignore_eos=True).token_ids
        seeded = dict(max_new_tokens=12, temperature=1.0, seed=4)
        assert cached.generate(ids, **seeded).token_ids == plain.generate(ids, **seeded).token_ids
    assert cached.prefix_cache.num_bytes > 0 and plain.prefix_cache.num_bytes == 0


def test_a_hit_prefills_only_the_rest(engines):
    cached, _ = engines
    ids = SYSTEM + [70, 71]
    cached.generate(ids, max_new_tokens=1)  # its blocks are cached now
    with_chunks = Engine.load(cached.folder, provider="cpu", prefill_chunk=16, prefix_cache=16)
    with_chunks.generate(ids, max_new_tokens=1)  # 10 chunks of 16 for 152 tokens, then cached
    runs = count_graph_runs(with_chunks)
    with_chunks.generate(ids, max_new_tokens=1)
    assert len(runs) == 2  # 24 tokens after the 128 cached: 2 chunks, and the one token needs no decode
    del with_chunks.runner.graph.session.run_with_iobinding


def test_a_prompt_that_shares_only_part_of_a_block_uses_the_whole_blocks_before_it(engines):
    cached, plain = engines
    cached.generate(SYSTEM, max_new_tokens=1)
    ids = SYSTEM[:40] + [90, 91, 92]  # 32 tokens of the first block, then 8 of the second, then others
    before = cached.prefix_cache.hit_tokens
    assert (
        cached.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids
        == plain.generate(ids, max_new_tokens=10, ignore_eos=True).token_ids
    )
    assert cached.prefix_cache.hit_tokens - before == 32
    changed = [SYSTEM[0] + 1] + SYSTEM[1:]  # one token differs in the first block: nothing matches
    before = cached.prefix_cache.hit_tokens
    cached.generate(changed, max_new_tokens=1)
    assert cached.prefix_cache.hit_tokens == before


def test_the_budget_is_kept_least_recently_used_first(tiny_llama):
    """(One layout: eviction is the cache's own business.)"""
    engine = Engine.load(tiny_llama[1], provider="cpu", prefix_cache=0)
    block_bytes = engine.memory.kv_per_token * 32
    engine.prefix_cache.budget = 3 * block_bytes
    engine.generate(SYSTEM[:64] + [1], max_new_tokens=1)  # 2 blocks
    engine.generate(QUESTIONS[1] * 13, max_new_tokens=1)  # 65 tokens: 2 more blocks, the oldest goes
    assert engine.prefix_cache.num_bytes == 3 * block_bytes
    before = engine.prefix_cache.hit_tokens
    engine.generate(SYSTEM[:64] + [1], max_new_tokens=1)
    assert engine.prefix_cache.hit_tokens == before  # its first block left first, so the chain is gone


def test_the_scheduler_reuses_prompts_and_answers_as_alone(engines):
    cached, plain = engines
    with Scheduler(cached, max_batch=3) as scheduler:
        first = scheduler.submit(SYSTEM + QUESTIONS[0], max_new_tokens=8, ignore_eos=True).result()
        before = cached.prefix_cache.hit_tokens
        requests = [scheduler.submit(SYSTEM + q, max_new_tokens=8, ignore_eos=True) for q in QUESTIONS]
        results = [r.result() for r in requests]
    assert cached.prefix_cache.hit_tokens - before == 3 * 128
    assert first.token_ids == results[0].token_ids
    for question, result in zip(QUESTIONS, results):
        assert result.token_ids == plain.generate(SYSTEM + question, max_new_tokens=8, ignore_eos=True).token_ids


def test_a_batch_whose_rows_start_from_the_cache_prefills_each_row_from_its_blocks(exports):
    """A batch leaves its rows' blocks in the cache. A later batch with cached starts prefills each
    row alone from its cached blocks (a row with none from its first token), then every row's last
    prompt token in one pass: the logits and tokens equal the cache off."""
    cached, plain = (Engine.load(exports["in place"], provider="cpu", prefix_cache=budget, prefill_chunk=16) for budget in (16, 0))
    first = [SYSTEM + q for q in QUESTIONS] + [[250 - i for i in range(45)]]
    logits = [
        engine.runner.prefill(engine.runner.new_batch(len(first), 200), first).numpy() for engine in (cached, plain)
    ]  # nothing cached yet: one pass
    np.testing.assert_array_equal(*logits)
    assert cached.prefix_cache.hit_tokens == 0 and cached.prefix_cache.num_bytes > 0
    batch = first + [[260 - i for i in range(40)]]  # a row whose start is not cached
    runs = count_graph_runs(cached)
    np.testing.assert_allclose(
        cached.runner.prefill(cached.runner.new_batch(len(batch), 200), batch).numpy(),
        plain.runner.prefill(plain.runner.new_batch(len(batch), 200), batch).numpy(),
        atol=1e-5,
    )
    assert cached.prefix_cache.hit_tokens == 3 * 128 + 32
    assert len(runs) == 3 * 2 + 1 + 3 + 1  # the rest before the last token, 16 at a time: 22-26 tokens, 12, 39; then the last tokens
    del cached.runner.graph.session.run_with_iobinding
    settings = dict(max_new_tokens=10, ignore_eos=True)
    assert (
        [r.token_ids for r in cached.generate_batch(batch, **settings)]
        == [r.token_ids for r in plain.generate_batch(batch, **settings)]
        == [plain.generate(p, **settings).token_ids for p in batch]
    )


def test_a_bad_budget_is_refused(tiny_llama):
    from edgeinfer.sdk.errors import SettingsError

    with pytest.raises(SettingsError, match=r"prefix_cache must be a number of MiB of at least 0 \(0 turns it off\), got -1"):
        Engine.load(tiny_llama[1], provider="cpu", prefix_cache=-1)


def test_a_conversations_next_turn_reuses_the_turns_before_it(engines):
    cached, plain = engines
    turns = [{"role": "system", "content": "You are an edge box. " * 6}, {"role": "user", "content": "Hi"}]
    first = cached.chat(turns, max_new_tokens=8)
    asked = len(cached.chat_prompt(turns))
    turns += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
    before = cached.prefix_cache.hit_tokens
    second = cached.chat(turns, max_new_tokens=8)
    assert cached.prefix_cache.hit_tokens - before == asked // 32 * 32  # every whole block of the first turn's prompt
    assert asked >= 64 and second.token_ids == plain.chat(turns, max_new_tokens=8).token_ids


def test_where_buffers_have_no_host_view_the_cache_is_copied_with_the_same_logits(exports):
    """CUDA's path, run on the CPU: a row's cached tokens are copied into the buffers, and a
    prefilled row's blocks out of them, head by head (runtime.RowCopy), for a single prompt and
    for each row of a batch."""
    from edgeinfer.sdk.runtime import RowCopy

    engine, plain = (Engine.load(exports["in place"], provider="cpu", prefix_cache=budget) for budget in (16, 0))
    engine.runner.copier = RowCopy(engine.manifest.kv.dtype, "cpu")

    def copying(prompts):
        return engine.runner.prefill(engine.runner.new_batch(len(prompts), 200), prompts).numpy()

    copying([SYSTEM + [99]])
    for question in QUESTIONS:
        before = engine.prefix_cache.hit_tokens
        np.testing.assert_array_equal(copying([SYSTEM + question]), prefill_logits(plain, SYSTEM + question))
        assert engine.prefix_cache.hit_tokens - before == 128
    batch = [SYSTEM + q for q in QUESTIONS] + [[250 - i for i in range(45)]]
    before = engine.prefix_cache.hit_tokens
    np.testing.assert_allclose(copying(batch), plain.runner.prefill(plain.runner.new_batch(len(batch), 200), batch).numpy(), atol=1e-5)
    assert engine.prefix_cache.hit_tokens - before == 3 * 128


def test_where_the_pool_has_no_host_view_its_rows_are_copied_head_by_head(exports):
    """The server's pool on CUDA, run on the CPU: cached blocks are copied into a row, and a
    prefilled row's blocks out of it, through an Identity graph bound at the row's addresses."""
    from edgeinfer.sdk.runtime import RowCopy

    engine, plain = (Engine.load(exports["in place"], provider="cpu", prefix_cache=budget) for budget in (16, 0))
    runner = engine.runner
    runner.copier = RowCopy(engine.manifest.kv.dtype, "cpu")
    pool = runner.new_batch(3, 256)

    def prefill(row, ids):
        pool.cache.release(row)
        start = runner.restore(pool, row, ids)
        for begin in range(start, len(ids), 64):
            logits = runner.prefill_span(pool, row, ids, begin, min(begin + 64, len(ids)))
        runner.store(pool, row, ids)
        return start, logits.numpy()

    assert prefill(0, SYSTEM + [99])[0] == 0 and engine.prefix_cache.num_bytes > 0
    for slot, question in enumerate(QUESTIONS):  # into rows 0, 1 and 2
        start, logits = prefill(slot, SYSTEM + question)
        assert start == 128
        np.testing.assert_allclose(logits, prefill_logits(plain, SYSTEM + question), atol=1e-5)
