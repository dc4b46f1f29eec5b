"""The scheduler's plan driven by a stand-in runner: no model, no graph. The stand-in keeps the real
slot cache's books and logs every pass; its "model" says the token after t is t + 1. Admission,
the order of passes (a long prompt's chunks interleaved with the other rows' decode passes),
cancellation and the queue limit are checked exactly."""

import threading
import time

import pytest

from edgeinfer import BusyError, GenerationConfig, GraphError, Scheduler
from edgeinfer.sdk.kv_cache import SlotCache
from edgeinfer.sdk.manifest import KVSpec
from edgeinfer.sdk.inputs import prepare_decode, prepare_row
from edgeinfer.sdk.runner import Batch
from edgeinfer.sdk.sequence import Sequence

SPEC = KVSpec(
    num_layers=1,
    num_kv_heads=1,
    head_size=1,
    dtype="float32",
    sequence_axis=2,
    past=["past.0.key", "past.0.value"],
    present=["present.0.key", "present.0.value"],
)


class StandInRunner:
    batches_continuously, is_static = True, False

    def __init__(self):
        self.passes, self.started = [], []  # every pass; the first token of each prompt, as its prefill starts

    def new_batch(self, num_rows, capacity, reuses_logits=False):
        return Batch(SlotCache(SPEC, {}, num_rows, capacity), reuses_logits)

    def restore(self, batch, row, ids):
        return 0

    def assign(self, batch, row, adapter):
        if adapter == "broken":  # as where an adapter's graph cannot be loaded
            raise GraphError("the adapters' graph failed to load")

    def store(self, batch, row, ids):
        pass

    def prefill_span(self, batch, row, ids, start, end):
        prepare_row(batch.cache, row, ids[start:end])
        self.passes.append(("prefill", row, start, end))
        if start == 0:
            self.started.append(ids[0])
        return {0: ids[end - 1] + 1}

    def decode(self, batch, tokens):
        time.sleep(0.001)  # a pass takes time, so that a caller can act between passes
        prepare_decode(batch.cache, tokens)
        self.passes.append(("decode", *[row for row, t in enumerate(tokens) if t is not None]))
        return {row: t + 1 for row, t in enumerate(tokens) if t is not None}

    def choose(self, logits, sequences, positions, bindings=None):
        return [logits[p] for p in positions]


class Letters:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


class StandInEngine:
    prefill_chunk, max_context = 4, 4096

    def __init__(self):
        self.runner, self.tokenizer = StandInRunner(), Letters()

    def check_memory(self, num_rows, capacity):
        pass

    def prepare(self, prompts, config=None, **settings):
        config = GenerationConfig(**settings)
        return [Sequence(list(p), config, config.max_new_tokens, (), self.tokenizer, time.perf_counter()) for p in prompts]


def queued(scheduler, *jobs):
    """Submit every (prompt, max_new_tokens) while the step loop waits, so that they arrive together."""
    with scheduler._wake:
        return [scheduler.submit(prompt, max_new_tokens=count) for prompt, count in jobs]


def test_a_long_prompt_is_prefilled_chunk_by_chunk_while_the_other_row_decodes():
    engine = StandInEngine()
    with Scheduler(engine, max_batch=2) as scheduler:
        short, long = queued(scheduler, ([10, 11], 6), (list(range(100, 112)), 3))
        assert short.result().token_ids == [12, 13, 14, 15, 16, 17]
        assert long.result().token_ids == [112, 113, 114]
    assert engine.runner.passes == [
        ("prefill", 0, 0, 2),
        ("decode", 0),
        ("prefill", 1, 0, 4),
        ("decode", 0),
        ("prefill", 1, 4, 8),
        ("decode", 0),
        ("prefill", 1, 8, 12),
        ("decode", 0, 1),
        ("decode", 0, 1),
    ]


def test_requests_past_the_rows_wait_and_take_the_first_row_freed():
    engine = StandInEngine()
    with Scheduler(engine, max_batch=2) as scheduler:
        requests = queued(scheduler, ([1], 2), ([20], 4), ([40], 1))
        assert [r.result().token_ids for r in requests] == [[2, 3], [21, 22, 23, 24], [41]]
    prefills = [p for p in engine.runner.passes if p[0] == "prefill"]
    assert prefills == [("prefill", 0, 0, 1), ("prefill", 1, 0, 1), ("prefill", 0, 0, 1)]  # the third took row 0 once freed


def test_a_cancelled_request_frees_its_row_and_a_waiting_one_leaves_the_queue():
    engine = StandInEngine()
    with Scheduler(engine, max_batch=1, max_queue=4) as scheduler:
        with scheduler._wake:
            running = scheduler.submit([1], max_new_tokens=2000)
            waiting = scheduler.submit([5], max_new_tokens=3)
            waiting.cancel()
        pieces = iter(running)
        next(pieces)
        running.cancel()
        assert len(list(pieces)) < 1999 and list(waiting) == []
        after = scheduler.submit([7], max_new_tokens=2).result()
        assert after.token_ids == [8, 9]
        for _ in range(1000):
            if scheduler.num_free_rows == 1 and scheduler.running == 0:
                break
            threading.Event().wait(0.001)
        assert (scheduler.num_free_rows, scheduler.running, scheduler.waiting) == (1, 0, 0)
    assert [p for p in engine.runner.passes if p[0] == "prefill"] == [("prefill", 0, 0, 1)] * 2  # the cancelled waiting one never ran


def test_the_queue_limit_counts_the_requests_waiting_for_a_row():
    engine = StandInEngine()
    with Scheduler(engine, max_batch=1, max_queue=1) as scheduler:
        with scheduler._wake:
            first, second = scheduler.submit([1], max_new_tokens=2), scheduler.submit([3], max_new_tokens=2)
            with pytest.raises(BusyError, match=r"1 requests are already waiting \(max_queue 1\): retry later"):
                scheduler.submit([5], max_new_tokens=2)
        assert [first.result().token_ids, second.result().token_ids] == [[2, 3], [4, 5]]


def test_waiting_requests_take_rows_in_the_order_they_came_and_prefill_one_at_a_time():
    """Fairness: first come, first served for rows, and one prompt's chunks at a time, so a later long
    prompt does not delay an earlier one; the running rows decode between every chunk."""
    engine = StandInEngine()
    with Scheduler(engine, max_batch=2) as scheduler:
        jobs = [([1], 6), (list(range(100, 108)), 2), (list(range(200, 208)), 2), ([30], 1), ([40], 1)]
        requests = queued(scheduler, *jobs)
        assert [r.result().token_ids for r in requests] == [[2, 3, 4, 5, 6, 7], [108, 109], [208, 209], [31], [41]]
    assert engine.runner.started == [1, 100, 200, 30, 40]  # the order they came
    prefills = [(p[1], p[2]) for p in engine.runner.passes if p[0] == "prefill"]
    assert prefills[:3] == [(0, 0), (1, 0), (1, 4)]  # the second prompt's chunks one after the other
    passes = engine.runner.passes
    chunked = [i for i, p in enumerate(passes) if p[0] == "prefill" and p[1] == 1 and p[2] == 4]
    assert passes[chunked[0] - 1] == ("decode", 0)  # row 0 decoded between the two chunks


def test_a_row_whose_adapter_cannot_be_served_gets_the_error_and_the_others_run_on():
    engine = StandInEngine()
    with Scheduler(engine, max_batch=2) as scheduler:
        broken, fine = scheduler.submit([1], max_new_tokens=2, adapter="broken"), scheduler.submit([5], max_new_tokens=2)
        with pytest.raises(GraphError, match="the adapters' graph failed to load"):
            broken.result()
        assert fine.result().token_ids == [6, 7]
        assert scheduler.submit([9], max_new_tokens=1).result().token_ids == [10]
