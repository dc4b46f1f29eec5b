"""Continuous batching (sdk/scheduler.py) on the tiny llama, without HTTP: requests from many threads
join and leave one running batch, and each gets exactly what it gets alone."""

import os
import threading

import pytest
from conftest import count_graph_runs, in_threads

from edgeinfer import BusyError, Engine, Scheduler
from edgeinfer.export import ExportOptions, export_model
from edgeinfer.sdk.errors import GenerationError, SettingsError

PROMPTS = [
    list(range(3, 200)),
    [5, 6],
    "The capital of France is",
    list(range(40, 60)),
    "Hi",
    list(range(100, 150)),
    "Edge boxes run small language models.",
    [7] * 30,
]
SETTINGS = [
    {},
    {},
    {"temperature": 0.9, "seed": 3},
    {},
    {"temperature": 1.0, "top_k": 5, "seed": 1},
    {"stop": ["x", "ed"]},
    {"repetition_penalty": 1.3},
    {"temperature": 0.7, "top_p": 0.9, "seed": 9},
]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.load(tiny_llama[1], provider="cpu", prefill_chunk=7)  # a 197-token prompt takes 29 chunks


def solo(engine, index, new_tokens=16):
    return engine.generate(PROMPTS[index], max_new_tokens=new_tokens, **SETTINGS[index])


def test_sixteen_callers_in_threads_each_get_what_they_get_alone(engine):
    jobs = [(i % len(PROMPTS), 8 + 3 * i) for i in range(16)]  # every prompt twice, 8 to 53 new tokens
    expected = [solo(engine, index, tokens) for index, tokens in jobs]
    results = [None] * len(jobs)

    def call(job):
        index, tokens = jobs[job]
        results[job] = scheduler.submit(PROMPTS[index], max_new_tokens=tokens, **SETTINGS[index]).result()

    with Scheduler(engine, max_batch=4) as scheduler:
        errors = in_threads(call, len(jobs))
    assert errors == []
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert [(r.text, r.finish_reason, r.prompt_tokens) for r in results] == [
        (e.text, e.finish_reason, e.prompt_tokens) for e in expected
    ]


def test_rows_decode_together_in_one_pass(engine):
    """Eight requests of 32 tokens: batched, the decode passes are shared, so the graph runs far
    fewer times than the 256 tokens made (alone: one run per token, plus the prefills)."""
    runs = count_graph_runs(engine)
    with Scheduler(engine, max_batch=8) as scheduler:
        with scheduler._wake:  # the step loop waits here, so all eight are queued before its first step
            requests = [scheduler.submit([5 + i, 6, 7], max_new_tokens=32, ignore_eos=True) for i in range(8)]
        made = sum(len(r.result().token_ids) for r in requests)
    assert made == 256
    assert len(runs) <= 8 + 32 + 8  # 8 prefills, and about one decode pass per token position
    del engine.runner.graph.session.run_with_iobinding  # the counter: back to the session's own method


def test_a_short_request_joins_the_running_batch_and_leaves_first(engine):
    with Scheduler(engine, max_batch=4) as scheduler:
        # a short prompt and most of the context: the long one is still decoding when the short one ends
        long = iter(scheduler.submit(PROMPTS[1], max_new_tokens=240, ignore_eos=True))
        first = [next(long) for _ in range(3)]  # the long one is decoding
        short = scheduler.submit("Hi", max_new_tokens=4).result()
        assert scheduler.running == 1  # the short one has come and gone while the long one runs
        rest = list(long)
    assert short.token_ids == engine.generate("Hi", max_new_tokens=4).token_ids
    tokens = [t for piece in first + rest for t in piece.token_ids]
    assert tokens == engine.generate(PROMPTS[1], max_new_tokens=240, ignore_eos=True).token_ids


def test_a_cancelled_request_frees_its_row_and_the_others_go_on(engine):
    with Scheduler(engine, max_batch=2) as scheduler:
        doomed_request = scheduler.submit([5, 6, 7], max_new_tokens=200, ignore_eos=True)
        kept = scheduler.submit("The capital of France is", max_new_tokens=30)
        doomed = iter(doomed_request)
        next(doomed)
        doomed_request.cancel()
        assert len(list(doomed)) < 199  # it ended early
        assert kept.result().token_ids == engine.generate("The capital of France is", max_new_tokens=30).token_ids
        for _ in range(1000):  # the row is back in the pool within a step
            if scheduler.num_free_rows == 2:
                break
            threading.Event().wait(0.001)
        assert scheduler.num_free_rows == 2 and scheduler.running == 0


def test_bad_requests_are_refused_in_the_callers_thread_and_the_queue_has_a_limit(engine):
    with Scheduler(engine, max_batch=1, max_queue=2) as scheduler:
        with pytest.raises(SettingsError, match="top_p must be a number in"):
            scheduler.submit("Hi", top_p=2.0)
        running = scheduler.submit([5, 6, 7], max_new_tokens=200, ignore_eos=True)
        next(iter(running))  # admitted: the queue is empty again
        queued = [scheduler.submit("Hi", max_new_tokens=2) for _ in range(2)]
        with pytest.raises(BusyError, match=r"2 requests are already waiting \(max_queue 2\): retry later"):
            scheduler.submit("Hi", max_new_tokens=2)
        assert [len(q.result().token_ids) for q in queued] == [2, 2]
    with pytest.raises(BusyError, match="shutting down"):
        scheduler.submit("Hi")


def test_closing_ends_the_running_requests_with_length_after_the_grace(engine):
    scheduler = Scheduler(engine, max_batch=2)
    requests = [scheduler.submit([5 + i, 6, 7], max_new_tokens=240, ignore_eos=True) for i in range(3)]
    next(iter(requests[0]))
    scheduler.close(grace=0.0)
    results = [r.result() for r in requests]
    assert {r.finish_reason for r in results} == {"length"} and all(len(r.token_ids) < 240 for r in results)
    assert not scheduler._thread.is_alive()


def test_an_export_that_does_not_write_its_cache_in_place_is_served_one_request_at_a_time(tiny_llama, tmp_path):
    export_model(str(tiny_llama[0]), tmp_path / "growing", ExportOptions(fuse=False))
    engine = Engine.load(tmp_path / "growing", provider="cpu")
    with Scheduler(engine, max_batch=4) as scheduler:
        assert scheduler.mode.startswith("one request at a time")
        requests = [scheduler.submit(PROMPTS[i], max_new_tokens=12, **SETTINGS[i]) for i in range(4)]
        assert [r.result().token_ids for r in requests] == [solo(engine, i, 12).token_ids for i in range(4)]


def test_the_pool_must_fit_the_memory_plan(tiny_llama):
    engine = Engine.load(tiny_llama[1], provider="cpu")
    tight = Engine.load(tiny_llama[1], provider="cpu", memory_limit=engine.memory.weights + engine.memory.kv_per_token * 256 * 3)
    with pytest.raises(GenerationError, match="4 rows of 256 tokens need .* run at most 3 prompts at a time"):
        Scheduler(tight, max_batch=4)
    with Scheduler(tight, max_batch=3) as scheduler:
        assert len(scheduler.submit("Hi", max_new_tokens=5).result().token_ids) == 5


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads the thread's CPU time from /proc")
def test_an_idle_scheduler_uses_no_cpu(engine):
    def cpu_ticks(thread):
        fields = open(f"/proc/self/task/{thread.native_id}/stat").read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    with Scheduler(engine) as scheduler:
        scheduler.submit("Hi", max_new_tokens=4).result()
        before = cpu_ticks(scheduler._thread)
        threading.Event().wait(0.5)  # the interval measured, not a wait for a condition
        assert cpu_ticks(scheduler._thread) - before <= 1


def test_the_queue_limit_counts_only_requests_that_wait_for_a_row(engine):
    """Requests that arrive together, while rows are free, are not 'waiting' even before the loop
    has given them their rows: max_queue=0 takes exactly max_batch of them."""
    with Scheduler(engine, max_batch=3, max_queue=0) as scheduler:
        with scheduler._wake:  # the loop cannot admit anyone while the requests come in
            requests = [scheduler.submit([5 + i, 6, 7], max_new_tokens=8) for i in range(3)]
            with pytest.raises(BusyError, match=r"0 requests are already waiting \(max_queue 0\)"):
                scheduler.submit("Hi", max_new_tokens=2)
        assert [len(r.result().token_ids) for r in requests] == [8, 8, 8]
