"""Property-based tests: whatever settings, prompt or batch an app passes, the call either succeeds
with a well-formed result or is refused with the edgeinfer error that names the problem. Which of
the two must happen is decided first, by `expected_refusal` (the rules of the README written out
again, independently of the code), and the test asserts it both ways: a call the rules allow must
succeed, and a call they forbid must raise that error."""

import math
import numbers
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edgeinfer import Engine
from edgeinfer.sdk.errors import ContextLengthError, EdgeInferError, GenerationError, SettingsError

VOCAB, CONTEXT = 320, 256
FINISH = {"eos", "stop", "length"}

# Each setting drawn from values it takes and values it must refuse.
FORMATS = [
    {"type": "text"},
    {"type": "json_object"},
    {"type": "regex", "pattern": "[0-9]+"},
    {"type": "regex"},
    {"type": "grammar", "lark": 'start: "a" | "b"'},
    {"type": "xml"},
    {"type": "json_object", "schema": {}},
    "json",
]
VALID_FORMATS = FORMATS[:3] + FORMATS[4:5]
ANY = st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.floats(allow_nan=True), st.integers(-10, 10))
SETTING_VALUES = {
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
    "presence_penalty": st.one_of(st.floats(-3, 3), ANY),
    "frequency_penalty": st.one_of(st.floats(-3, 3), ANY),
    "logit_bias": st.one_of(st.dictionaries(st.integers(-2, VOCAB + 2), st.floats(-120, 120), max_size=3), ANY),
    "logprobs": ANY,
    "top_logprobs": st.one_of(st.integers(-2, 25), ANY),
    "choice": st.one_of(st.lists(st.text(max_size=3), max_size=3), ANY),
    "response_format": st.one_of(st.sampled_from(FORMATS), ANY),
}
SETTINGS = st.fixed_dictionaries({}, optional={**SETTING_VALUES, "unknown_setting": st.integers()})
# Settings in their ranges, and prompts that fit the context.
_VALID = st.fixed_dictionaries(
    {"seed": st.integers(0, 2**32)},
    optional={
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
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3),
        "logprobs": st.just(True),
        "constraint": st.one_of(
            st.sampled_from([{"response_format": f} for f in VALID_FORMATS]),
            st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=3).map(lambda c: {"choice": c}),
        ),
    },
)


def _allowed_together(asked: dict, top_logprobs: int) -> dict:
    """top_logprobs only with logprobs; a constraint without ignore_eos."""
    asked = dict(asked)
    asked.update(asked.pop("constraint", {}))
    if asked.get("logprobs"):
        asked["top_logprobs"] = top_logprobs
    if "choice" in asked or asked.get("response_format") not in (None, {"type": "text"}):
        asked.pop("ignore_eos", None)
    return asked


VALID_SETTINGS = st.builds(_allowed_together, _VALID, st.integers(0, 20))
VALID_PROMPTS = st.one_of(
    st.text(min_size=1, max_size=60),  # at most 240 bytes: tokens that fit the context
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=CONTEXT - 1),
)
TOKEN_PROMPTS = st.lists(st.integers(-3, VOCAB + 3), max_size=CONTEXT + 40)
PROMPTS = st.one_of(st.text(max_size=200), TOKEN_PROMPTS, VALID_PROMPTS)
CHECKS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.load(tiny_llama[1], provider="cpu")


# The rules, written out again: each returns None where the value is allowed, else the words the
# refusal must contain.


def _integer(value, low):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low


def _real(value, allowed):
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and allowed(value)


RULES = {
    "max_new_tokens": lambda v: _integer(v, 1),
    "temperature": lambda v: _real(v, lambda x: x >= 0),
    "top_k": lambda v: _integer(v, 0),
    "top_p": lambda v: _real(v, lambda x: 0 < x <= 1),
    "min_p": lambda v: _real(v, lambda x: 0 <= x <= 1),
    "repetition_penalty": lambda v: _real(v, lambda x: x > 0),
    "seed": lambda v: v is None or _integer(v, 0),
    "stop": lambda v: (isinstance(v, str) and v != "") or (isinstance(v, (list, tuple)) and all(isinstance(s, str) and s for s in v)),
    "stop_token_ids": lambda v: _integer(v, 0) or (isinstance(v, (list, tuple)) and all(_integer(t, 0) for t in v)),
    "ignore_eos": lambda v: isinstance(v, bool),
    "truncate": lambda v: v in (None, "left"),
    "presence_penalty": lambda v: _real(v, lambda x: -2 <= x <= 2),
    "frequency_penalty": lambda v: _real(v, lambda x: -2 <= x <= 2),
    "logit_bias": lambda v: (
        v is None or (isinstance(v, dict) and all(_integer(t, 0) and _real(b, lambda x: -100 <= x <= 100) for t, b in v.items()))
    ),
    "logprobs": lambda v: isinstance(v, bool),
    "top_logprobs": lambda v: _integer(v, 0),
    "choice": lambda v: v is None or (isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(c, str) and c for c in v)),
    "response_format": lambda v: v is None or v in VALID_FORMATS,
}
# What a refusal of each rule says (by default "NAME must be").
SAYS = {"logit_bias": r"logit_bias( keys|\[.*\])? must", "response_format": "response_format (must|of type)"}


def expected_refusal(engine, prompts: list, asked: dict) -> tuple[type, str] | None:
    """The error class and a pattern its message must match, where the call must be refused;
    None where it must succeed."""
    if "unknown_setting" in asked:
        return SettingsError, "unknown generation setting 'unknown_setting'"
    bad = [name for name, value in asked.items() if not RULES[name](value)]
    if bad:
        return SettingsError, "(" + "|".join(SAYS.get(name, f"{name} must be") for name in bad) + ")"
    if asked.get("top_logprobs", 0) > 20:
        return SettingsError, "top_logprobs must be at most 20"
    if asked.get("top_logprobs", 0) and not asked.get("logprobs"):
        return SettingsError, "top_logprobs needs logprobs=True"
    constrained = asked.get("choice") is not None or asked.get("response_format") not in (None, {"type": "text"})
    if asked.get("choice") is not None and asked.get("response_format") is not None:
        return SettingsError, "give response_format or choice, not both"
    if constrained and asked.get("ignore_eos"):
        return SettingsError, "ignore_eos cannot be used with a response_format or choice"
    stop_ids = asked.get("stop_token_ids", ())
    if any(t >= VOCAB for t in ([stop_ids] if isinstance(stop_ids, int) else stop_ids)):
        return SettingsError, r"stop_token_ids .* are outside the vocabulary \(0..319\)"
    if any(t >= VOCAB for t in (asked.get("logit_bias") or {})):
        return SettingsError, r"logit_bias .* are outside the vocabulary \(0..319\)"
    lengths = []
    for prompt in prompts:
        ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if not isinstance(prompt, str) and any(not 0 <= t < VOCAB for t in prompt):
            return GenerationError, r"token ids .* are outside the vocabulary \(0..319\)"
        if not ids:
            return GenerationError, "the prompt is empty"
        lengths.append(len(ids))
    if max(lengths) >= CONTEXT and asked.get("truncate") != "left":
        return ContextLengthError, f"has {max(lengths)} tokens but the model's context is {CONTEXT}"
    return None


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


def assert_as_expected(call, expected):
    """Run `call`; it must raise exactly the expected refusal, or succeed where none is expected."""
    if expected is None:
        return call()
    error, pattern = expected
    with pytest.raises(EdgeInferError) as raised:
        call()
    assert type(raised.value) is error and re.search(pattern, str(raised.value)), (expected, raised.value)
    return None


@CHECKS
@given(prompt=PROMPTS, asked=st.one_of(SETTINGS, VALID_SETTINGS))
def test_a_call_succeeds_or_is_refused_exactly_as_the_rules_say(engine, prompt, asked):
    expected = expected_refusal(engine, [prompt], asked)
    result = assert_as_expected(lambda: engine.generate(prompt, **asked), expected)
    if result is not None:
        assert_well_formed(result, asked)


@CHECKS
@given(prompt=VALID_PROMPTS, asked=VALID_SETTINGS)
def test_valid_calls_succeed_and_stream_the_decode_of_their_tokens(engine, prompt, asked):
    assert expected_refusal(engine, [prompt], asked) is None  # the strategies draw only allowed calls
    pieces = list(engine.stream(prompt, **asked))
    result = engine.generate(prompt, **asked)
    assert_well_formed(result, asked)
    assert all(p.finish_reason is None for p in pieces[:-1]) and pieces[-1].finish_reason == result.finish_reason
    tokens, text = [t for p in pieces for t in p.token_ids], "".join(p.text for p in pieces)
    assert tokens == result.token_ids and text == result.text  # seeded: the same draws both times
    decoded = engine.tokenizer.decode(tokens)  # the whole decode, against the pieces made token by token
    stops = [asked["stop"]] if isinstance(asked.get("stop"), str) else asked.get("stop", [])
    if any(decoded[len(text) :].startswith(s) for s in stops):
        assert decoded.startswith(text)  # a stop string: the text ends where it begins
    else:
        assert text == decoded


# One setting at a time, so that no other bad value can hide a rule that lets a bad one through,
# with each rule's edges given explicitly.
ONE_SETTING = st.one_of(*[st.tuples(st.just(name), values) for name, values in SETTING_VALUES.items()])
EDGES = [
    ("max_new_tokens", 1),
    ("max_new_tokens", 0),
    ("max_new_tokens", True),
    ("temperature", 0.0),
    ("temperature", -1e-9),
    ("temperature", math.inf),
    ("top_k", 0),
    ("top_k", -1),
    ("top_k", 2.0),
    ("top_p", 1.0),
    ("top_p", 1.0 + 1e-9),
    ("top_p", 0.0),
    ("min_p", 0.0),
    ("min_p", 1.0),
    ("min_p", 1.0 + 1e-9),
    ("repetition_penalty", 1e-9),
    ("repetition_penalty", 0.0),
    ("seed", 0),
    ("seed", -1),
    ("seed", None),
    ("stop", "x"),
    ("stop", ""),
    ("stop", ["a", ""]),
    ("stop_token_ids", VOCAB - 1),
    ("stop_token_ids", VOCAB),
    ("stop_token_ids", [0, -1]),
    ("ignore_eos", False),
    ("ignore_eos", 1),
    ("truncate", None),
    ("truncate", "right"),
    ("presence_penalty", 2.0),
    ("presence_penalty", 2.0 + 1e-9),
    ("frequency_penalty", -2.0),
    ("frequency_penalty", -2.0 - 1e-9),
    ("logit_bias", {VOCAB - 1: 100}),
    ("logit_bias", {VOCAB: 1}),
    ("logit_bias", {0: -100 - 1e-9}),
    ("logit_bias", {-1: 1}),
    ("logit_bias", None),
    ("logprobs", True),
    ("logprobs", 1),
    ("top_logprobs", 0),
    ("top_logprobs", 21),
    ("choice", ["a"]),
    ("choice", []),
    ("choice", [""]),
    ("response_format", {"type": "text"}),
    ("response_format", {"type": "regex", "pattern": ""}),
]


def with_edges(test):
    for setting in EDGES:
        test = example(setting=setting)(test)
    return test


@CHECKS
@with_edges
@given(setting=ONE_SETTING)
def test_each_setting_alone_is_taken_or_refused_as_its_rule_says(engine, setting):
    name, value = setting
    asked = {"max_new_tokens": 3, name: value}
    expected = expected_refusal(engine, [PROMPT_IDS], asked)
    result = assert_as_expected(lambda: engine.generate(PROMPT_IDS, **asked), expected)
    if result is not None:
        assert_well_formed(result, asked)


PROMPT_IDS = [5, 6, 7]


@CHECKS
@example(length=CONTEXT - 1, truncate=None)
@example(length=CONTEXT, truncate=None)
@example(length=CONTEXT, truncate="left")
@example(length=CONTEXT + 40, truncate="left")
@given(length=st.integers(1, CONTEXT + 40), truncate=st.sampled_from([None, "left"]))
def test_prompts_up_to_the_context_are_taken_and_longer_ones_refused_or_truncated(engine, length, truncate):
    """Lengths drawn evenly across the whole context and past it (a list strategy would mostly draw
    short prompts), with the edges given explicitly."""
    prompt, asked = [(7 * i) % VOCAB for i in range(length)], {"max_new_tokens": 4, "truncate": truncate}
    expected = expected_refusal(engine, [prompt], asked)
    result = assert_as_expected(lambda: engine.generate(prompt, **asked), expected)
    if result is not None:
        assert_well_formed(result, asked)
        assert result.prompt_tokens + result.truncated_tokens == length and result.prompt_tokens < CONTEXT


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(prompts=st.lists(PROMPTS, min_size=1, max_size=3), asked=st.one_of(SETTINGS, VALID_SETTINGS))
def test_a_batch_succeeds_or_is_refused_exactly_as_the_rules_say(engine, prompts, asked):
    expected = expected_refusal(engine, prompts, asked)
    results = assert_as_expected(lambda: engine.generate_batch(prompts, **asked), expected)
    if results is not None:
        assert len(results) == len(prompts)
        for result in results:
            assert_well_formed(result, asked)


@CHECKS
@given(text=st.text())
def test_any_unicode_text_round_trips_through_the_tokenizer(engine, text):
    assert engine.tokenizer.decode(engine.tokenizer.encode(text, add_special_tokens=False)) == text
