"""Generation settings: every bad value is refused with its name, its rule and the value given;
a call's settings come from the model's defaults, a config and keywords, in that order."""

import json

import pytest

from edgeinfer import GenerationConfig
from edgeinfer.sdk.errors import SettingsError
from edgeinfer.sdk.settings import FIELDS, resolve_settings

BAD = [
    ({"max_new_tokens": 0}, r"max_new_tokens must be an integer of at least 1, got 0"),
    ({"max_new_tokens": 2.5}, r"max_new_tokens must be an integer of at least 1, got 2.5"),
    ({"temperature": -0.1}, r"temperature must be a number at least 0 \(0 is greedy\), got -0.1"),
    ({"temperature": float("nan")}, r"temperature must be a number at least 0 .*, got nan"),
    ({"top_k": -1}, r"top_k must be an integer of at least 0 \(0 turns it off\), got -1"),
    ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\] \(1 turns it off\), got 0.0"),
    ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\] .*, got 1.5"),
    ({"min_p": -0.5}, r"min_p must be a number in \[0, 1\] \(0 turns it off\), got -0.5"),
    ({"repetition_penalty": 0}, r"repetition_penalty must be a number above 0 \(1 turns it off\), got 0"),
    ({"seed": -3}, r"seed must be an integer of at least 0 or None, got -3"),
    ({"seed": "7"}, r"seed must be an integer of at least 0 or None, got '7'"),
    ({"stop": ["ok", ""]}, r"stop must be a string or a list of non-empty strings, got \['ok', ''\]"),
    ({"stop": 5}, r"stop must be a string or a list of non-empty strings, got 5"),
    ({"stop_token_ids": [3, -1]}, r"stop_token_ids must be a list of token ids .*, got \[3, -1\]"),
    ({"ignore_eos": "yes"}, r"ignore_eos must be True or False, got 'yes'"),
    ({"truncate": "right"}, r"truncate must be 'left' \(keep the end of a long prompt\) or None, got 'right'"),
    ({"truncate": ["left"]}, r"truncate must be 'left' .* or None, got \['left'\]"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\] \(0 turns it off\), got 2.5"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be a number in \[-2, 2\] .*, got -3"),
    ({"logit_bias": {5: 101}}, r"logit_bias\[5\] must be a number in \[-100, 100\], got 101"),
    ({"logit_bias": {"x": 1}}, r"logit_bias keys must be token ids \(integers of at least 0\), got 'x'"),
    ({"logit_bias": [3]}, r"logit_bias must map token ids to numbers in \[-100, 100\], got \[3\]"),
    ({"top_logprobs": 21, "logprobs": True}, r"top_logprobs must be at most 20, got 21"),
    ({"top_logprobs": 3}, r"top_logprobs needs logprobs=True"),
    ({"logprobs": 1}, r"logprobs must be True or False, got 1"),
    ({"choice": []}, r"choice must be a non-empty list of non-empty strings, got \[\]"),
    ({"choice": ["a", ""]}, r"choice must be a non-empty list of non-empty strings"),
    (
        {"response_format": {"type": "xml"}},
        r"response_format must be a dict whose type is one of text, json_object, "
        r"json_schema, regex, grammar, got 'xml'",
    ),
    ({"response_format": "json"}, r"response_format must be a dict whose type is one of .*, got 'json'"),
    (
        {"response_format": {"type": "json_schema", "schema": {}}},
        r"response_format of type 'json_schema' takes "
        r"\['json_schema'\], not \['schema'\]",
    ),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, r"needs \{\"json_schema\": \{\"schema\""),
    ({"response_format": {"type": "regex"}}, r"response_format of type 'regex' needs 'pattern', a non-empty string"),
    ({"response_format": {"type": "grammar", "lark": ""}}, r"type 'grammar' needs 'lark', a non-empty string"),
    ({"response_format": {"type": "json_object"}, "choice": ["a"]}, r"give response_format or choice, not both"),
    ({"choice": ["a"], "ignore_eos": True}, r"ignore_eos cannot be used with a response_format or choice"),
]


@pytest.mark.parametrize("values, message", BAD, ids=[next(iter(v)) + "=" + repr(next(iter(v.values()))) for v, _ in BAD])
def test_invalid_settings_are_refused_with_the_rule(values, message):
    with pytest.raises(SettingsError, match=message):
        GenerationConfig(**values)


def test_settings_are_normalized():
    import numpy as np

    config = GenerationConfig(stop="\n", stop_token_ids=[np.int64(5)], top_k=np.int32(4), temperature=1)
    assert config.stop == ("\n",) and config.stop_token_ids == (5,)
    assert type(config.top_k) is int and type(config.temperature) is float


def test_response_formats_become_one_constraint():
    from edgeinfer.sdk.settings import Constraint

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert GenerationConfig(
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    ).constraint == Constraint("json_schema", json.dumps(schema))
    assert GenerationConfig(response_format={"type": "json_object"}).constraint == Constraint("json_schema", '{"type": "object"}')
    assert GenerationConfig(response_format={"type": "regex", "pattern": "a+"}).constraint == Constraint("regex", "a+")
    assert GenerationConfig(response_format={"type": "grammar", "lark": "start: /x/"}).constraint == Constraint("lark", "start: /x/")
    assert GenerationConfig(choice=["yes", "no"]).constraint == Constraint("choice", '["yes", "no"]')
    assert GenerationConfig(response_format={"type": "text"}).constraint is None
    assert GenerationConfig(logit_bias={"7": 2, 3: -1.5}).logit_bias == ((3, -1.5), (7, 2.0))


def test_greedy_means_nothing_is_sampled_or_penalized():
    assert GenerationConfig().chooses_by_argmax
    assert GenerationConfig(temperature=0.9, top_k=1).chooses_by_argmax
    assert not GenerationConfig(temperature=0.9).chooses_by_argmax
    assert not GenerationConfig(repetition_penalty=1.2).chooses_by_argmax
    for setting in (
        {"presence_penalty": 0.5},
        {"frequency_penalty": -0.5},
        {"logit_bias": {1: 1}},
        {"choice": ["a"]},
        {"response_format": {"type": "json_object"}},
        {"logprobs": True},
    ):
        assert not GenerationConfig(**setting).chooses_by_argmax, setting


def test_keywords_override_the_config_which_replaces_the_model_defaults():
    model = GenerationConfig(temperature=0.6, top_p=0.9, max_new_tokens=64)
    assert resolve_settings(model, None, {}) == model
    assert resolve_settings(model, None, {"seed": 3}) == GenerationConfig(temperature=0.6, top_p=0.9, max_new_tokens=64, seed=3)
    mine = GenerationConfig(top_k=5)
    assert resolve_settings(model, mine, {"max_new_tokens": 8}) == GenerationConfig(top_k=5, max_new_tokens=8)


def test_an_unknown_keyword_is_an_error_that_suggests_the_right_one():
    with pytest.raises(
        SettingsError,
        match=r"unknown generation setting 'temprature': did you mean 'temperature'\? "
        r"the settings are max_new_tokens, temperature",
    ):
        resolve_settings(GenerationConfig(), None, {"temprature": 0.5})
    with pytest.raises(SettingsError, match="config must be a GenerationConfig, got dict"):
        resolve_settings(GenerationConfig(), {"temperature": 1}, {})


def test_export_maps_the_models_generation_config_to_settings():
    from transformers import GenerationConfig as HFConfig

    from edgeinfer.export.manifest import generation_defaults

    assert generation_defaults(HFConfig()) == {}
    assert generation_defaults(HFConfig(do_sample=True, temperature=0.6, top_p=0.9, max_new_tokens=100)) == {
        "max_new_tokens": 100,
        "temperature": 0.6,
        "top_k": 50,
        "top_p": 0.9,
        "min_p": 0.0,
    }
    # sampling settings without do_sample are not used by transformers, so not by edgeinfer either
    assert generation_defaults(HFConfig(temperature=0.6, repetition_penalty=1.3)) == {"repetition_penalty": 1.3}
    assert set(generation_defaults(HFConfig(do_sample=True, repetition_penalty=1.1, max_new_tokens=5))) <= set(FIELDS)
