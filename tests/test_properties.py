"""Property-based tests: whatever settings, prompt or batch an app passes, a call returns a
well-formed result or raises an edgeinfer error, never anything else."""
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgeinfer import Engine
from edgeinfer.sdk.errors import EdgeInferError

VOCAB, CONTEXT = 320, 256
FINISH = {"eos", "stop", "length"}

# Each setting drawn from values it takes and values it must refuse.
ANY = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.floats(allow_nan=True), st.integers(-10, 10))
SETTINGS = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.one_of(st.integers(-2, 12), st.sampled_from([300, 10**6]), ANY),
    "temperature": st.one_of(st.floats(-1, 3), ANY),
    "top_k": st.one_of(st.integers(-1, 400), ANY),
    "top_p": st.one_of(st.floats(-0.5, 1.5), ANY),
    "min_p": st.one_of(st.floats(-0.5, 1.5), ANY),
    "repetition_penalty": st.one_of(st.floats(-1, 3), ANY),
    "seed": st.one_of(st.integers(-5, 2**40), ANY),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), ANY),
    "stop_token_ids": st.one_of(st.lists(st.integers(-3, VOCAB + 3), max_size=3), ANY),
    "ignore_eos": ANY,
    "truncate": st.one_of(st.just("left"), ANY),
    "unknown_setting": st.integers(),
})
# Settings in their ranges, and prompts that fit the context: these calls must succeed.
VALID_SETTINGS = st.fixed_dictionaries({"seed": st.integers(0, 2**32)}, optional={
    "max_new_tokens": st.one_of(st.integers(1, 12), st.just(10**6)),
    "temperature": st.floats(0, 2),
    "top_k": st.integers(0, 400),
    "top_p": st.floats(0.01, 1),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "truncate": st.sampled_from([None, "left"]),
})
VALID_PROMPTS = st.one_of(st.text(min_size=1, max_size=60),  # at most 240 bytes: tokens that fit the context
                          st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=CONTEXT - 1))
TOKEN_PROMPTS = st.lists(st.integers(-3, VOCAB + 3), max_size=CONTEXT + 40)
PROMPTS = st.one_of(st.text(max_size=200), TOKEN_PROMPTS, VALID_PROMPTS)
CHECKS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.load(tiny_llama[1], provider="cpu")


def assert_well_formed(result, asked):
    assert isinstance(result.text, str)
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in result.token_ids)
    assert result.finish_reason in FINISH
    assert 1 <= result.prompt_tokens and result.prompt_tokens + len(result.token_ids) <= CONTEXT
    limit = asked.get("max_new_tokens")
    if isinstance(limit, int) and not isinstance(limit, bool):
        assert len(result.token_ids) <= limit
    if result.finish_reason == "length":
        assert len(result.token_ids) >= 1
    assert math.isfinite(result.ttft_s) and result.ttft_s >= 0 and result.decode_tokens_per_s >= 0


@CHECKS
@given(prompt=PROMPTS, asked=st.one_of(SETTINGS, VALID_SETTINGS))
def test_generate_returns_a_result_or_an_edgeinfer_error(engine, prompt, asked):
    try:
        result = engine.generate(prompt, **asked)
    except EdgeInferError:
        return
    assert_well_formed(result, asked)


@CHECKS
@given(prompt=VALID_PROMPTS, asked=VALID_SETTINGS)
def test_valid_calls_succeed_and_streaming_gives_the_same_text(engine, prompt, asked):
    result = engine.generate(prompt, **asked)
    assert_well_formed(result, asked)
    pieces = list(engine.stream(prompt, **asked))
    assert all(p.finish_reason is None for p in pieces[:-1]) and pieces[-1].finish_reason == result.finish_reason
    assert "".join(p.text for p in pieces) == result.text
    assert [t for p in pieces for t in p.token_ids] == result.token_ids


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(prompts=st.lists(PROMPTS, min_size=1, max_size=3), asked=st.one_of(SETTINGS, VALID_SETTINGS))
def test_batches_return_one_result_per_prompt_or_an_edgeinfer_error(engine, prompts, asked):
    try:
        results = engine.generate(prompts, **asked)
    except EdgeInferError:
        return
    assert len(results) == len(prompts)
    for result in results:
        assert_well_formed(result, asked)


@CHECKS
@given(text=st.text())
def test_any_unicode_text_round_trips_through_the_tokenizer(engine, text):
    assert engine.tokenizer.decode(engine.tokenizer.encode(text, add_special_tokens=False)) == text
