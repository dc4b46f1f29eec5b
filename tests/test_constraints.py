"""Constrained decoding, logprobs and OpenAI's penalties on a tiny random-weight llama with an EOS:
every complete output matches its constraint, greedy tokens equal transformers' under the same
mask, and logprobs equal transformers' log-softmax."""

import json
import re

import jsonschema
import numpy as np
import pytest

from edgeinfer import Engine, GenerationConfig
from edgeinfer.sdk.constraints import JSON_DEFAULTS
from edgeinfer.sdk.errors import SettingsError

from conftest import EOS_ID, build_llama

PROMPT = "The capital of France is"
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "place": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 5}, "zone": {"type": "integer", "minimum": 1, "maximum": 12}},
                "required": ["city", "zone"],
                "additionalProperties": False,
            },
            "note": {"type": "string", "maxLength": 4},
        },
        "required": ["name", "place"],
        "additionalProperties": False,
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
            "level": {"enum": ["low", "high"]},
        },
        "required": ["tags", "level"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "ok": {"type": "boolean"},
        },
        "required": ["count", "ok"],
        "additionalProperties": False,
    },
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"


@pytest.fixture(scope="module")
def eos_llama(tmp_path_factory):
    """(HF model, export folder) of the tiny llama with <|im_end|> as its EOS."""
    from edgeinfer.export import export_model

    root = tmp_path_factory.mktemp("eos-llama")
    model = build_llama(root / "hf", eos_token_id=EOS_ID, seed=3)
    export_model(str(root / "hf"), root / "export")
    return model, root / "export"


@pytest.fixture(scope="module")
def engine(eos_llama):
    return Engine.load(eos_llama[1], provider="cpu")


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("name", SCHEMAS)
def test_sampled_outputs_that_complete_validate_against_their_schema(engine, name):
    """30 seeds at temperature 1.0, as one batch of 30 rows (each row its own seed): every output
    that ends complete parses and validates; most of them complete."""
    configs = [
        GenerationConfig(temperature=1.0, seed=seed, max_new_tokens=120, response_format=schema_format(SCHEMAS[name]))
        for seed in range(30)
    ]
    results = engine.generate_batch([PROMPT] * 30, configs)
    complete = [r for r in results if r.complete]
    for result in complete:
        assert result.finish_reason == "eos"
        jsonschema.validate(json.loads(result.text), SCHEMAS[name])
    assert len(complete) >= 20, [(r.finish_reason, r.text) for r in results if not r.complete]
    assert all(", " in r.text or r.text.count(":") <= 1 for r in complete)  # json.dumps' separators
    assert len({r.text for r in complete}) > 5  # the seeds really sampled
    for result in results:
        if not result.complete:  # cut by max_new_tokens: the raw text, never repaired
            assert result.finish_reason == "length" and len(result.token_ids) == 120
            assert result.text == engine.tokenizer.decode(result.token_ids)


def test_regex_and_choice_outputs_match(engine):
    regex = engine.generate_batch(
        [PROMPT] * 30,
        [
            GenerationConfig(temperature=1.0, seed=s, max_new_tokens=40, response_format={"type": "regex", "pattern": REGEX})
            for s in range(30)
        ],
    )
    assert all(r.complete and re.fullmatch(REGEX, r.text) for r in regex), [r.text for r in regex]
    choices = ["Paris", "Lyon", "a small village"]
    picked = [engine.generate(PROMPT, temperature=1.0, seed=s, choice=choices) for s in range(20)]
    assert all(r.text in choices and r.complete and r.finish_reason == "eos" for r in picked)
    assert len({r.text for r in picked}) > 1


def test_a_lark_grammar_and_json_object(engine):
    lark = 'start: "yes" | "no" | NUMBER\nNUMBER: /[1-9][0-9]?/'
    for seed in range(10):
        result = engine.generate(PROMPT, temperature=1.0, seed=seed, response_format={"type": "grammar", "lark": lark})
        assert result.complete and re.fullmatch(r"yes|no|[1-9][0-9]?", result.text), result.text
    anything = [
        engine.generate(PROMPT, temperature=1.0, seed=s, max_new_tokens=150, response_format={"type": "json_object"})
        for s in range(10)
    ]
    assert any(r.complete for r in anything)
    assert all(isinstance(json.loads(r.text), dict) for r in anything if r.complete)


def test_a_batch_whose_rows_have_different_constraints(engine):
    configs = [
        GenerationConfig(temperature=1.0, seed=1, max_new_tokens=120, response_format=schema_format(SCHEMAS["array_enum"])),
        GenerationConfig(temperature=1.0, seed=2, max_new_tokens=40, response_format={"type": "regex", "pattern": REGEX}),
        GenerationConfig(temperature=1.0, seed=3, choice=["north", "south"]),
        GenerationConfig(max_new_tokens=12),
    ]
    prompts = [PROMPT, "Edge boxes", PROMPT, PROMPT]
    results = engine.generate_batch(prompts, configs)
    for prompt, result, config in zip(prompts, results, configs):
        assert result.token_ids == engine.generate(prompt, config).token_ids  # each row as it is alone
    jsonschema.validate(json.loads(results[0].text), SCHEMAS["array_enum"])
    assert re.fullmatch(REGEX, results[1].text) and results[2].text in ("north", "south")
    assert results[3].complete is None and len(results[3].token_ids) == 12


def test_streaming_under_a_constraint_gives_the_same_text(engine):
    settings = {"temperature": 1.0, "seed": 5, "max_new_tokens": 120, "response_format": schema_format(SCHEMAS["nested"])}
    pieces = list(engine.stream(PROMPT, **settings))
    whole = engine.generate(PROMPT, **settings)
    assert "".join(p.text for p in pieces) == whole.text and pieces[-1].complete == whole.complete


def test_greedy_tokens_under_a_schema_equal_transformers_with_the_same_mask(engine, eos_llama):
    """A reference loop: transformers' logits, the mask of an independent llguidance matcher (JSON
    as json.dumps writes it, as edgeinfer compiles schemas), argmax; the engine's greedy
    constrained tokens equal it, EOS included."""
    import llguidance
    import torch

    model, _ = eos_llama
    schema = SCHEMAS["numbers"]
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)
    matcher = llguidance.LLMatcher(engine.constraints.tokenizer, grammar)
    ids, expected = engine.prompt_ids(PROMPT), []
    bitmask = np.zeros((1, (model.config.vocab_size + 31) // 32), np.int32)
    for _ in range(60):
        with torch.no_grad():
            logits = model(torch.tensor([ids + expected])).logits[0, -1].numpy()
        matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: logits.size].astype(bool)
        token = int(np.argmax(np.where(allowed, logits, -np.inf)))
        if token == EOS_ID or matcher.is_stopped():
            break
        matcher.consume_token(token)
        expected.append(token)
    result = engine.generate(PROMPT, max_new_tokens=60, response_format=schema_format(schema))
    assert result.token_ids == expected and result.complete
    jsonschema.validate(json.loads(result.text), schema)


def test_bad_constraints_are_settings_errors_before_any_work(engine):
    cases = [
        ({"response_format": {"type": "regex", "pattern": "[a-"}}, r"the regex cannot be used: .*"),
        ({"response_format": {"type": "grammar", "lark": "start: missing_rule"}}, r"the grammar cannot be used: .*"),
        (
            {"response_format": schema_format({"type": "object", "properties": {"a": {"type": "nonsense"}}})},
            r"the JSON schema cannot be used: .*",
        ),
        ({"response_format": {"type": "regex", "pattern": r"[^\s\S]"}}, r"no output can match the regex"),
        (
            {"response_format": schema_format({"type": "object", "minProperties": 2, "maxProperties": 1})},
            r"the JSON schema cannot be used: .*Unsatisfiable schema",
        ),
        ({"logit_bias": {320: 1}}, r"logit_bias \[320\] are outside the vocabulary \(0..319\)"),
    ]
    for settings, message in cases:
        with pytest.raises(SettingsError, match=message):
            engine.generate(PROMPT, **settings)


def test_a_constrained_output_cut_by_max_new_tokens_is_incomplete(engine):
    result = engine.generate(PROMPT, max_new_tokens=3, response_format=schema_format(SCHEMAS["nested"]))
    assert result.finish_reason == "length" and result.complete is False and len(result.token_ids) == 3
    assert result.text == engine.tokenizer.decode(result.token_ids) and result.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.text)


def test_logprobs_equal_transformers_log_softmax(engine, eos_llama):
    import torch

    model, _ = eos_llama
    result = engine.generate(PROMPT, max_new_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=5)
    ids = engine.prompt_ids(PROMPT)
    with torch.no_grad():
        logits = model(torch.tensor([ids + result.token_ids])).logits[0, len(ids) - 1 : -1].double()
    expected = torch.log_softmax(logits, -1).numpy()
    assert len(result.logprobs) == len(result.token_ids) == 12
    for step, (token, chosen) in enumerate(zip(result.token_ids, result.logprobs)):
        assert chosen.token == token
        assert abs(chosen.logprob - expected[step, token]) < 1e-4
        top = np.argsort(-expected[step])[:5]
        assert {t for t, _ in chosen.top} == set(top.tolist())
        for t, value in chosen.top:
            assert abs(value - expected[step, t]) < 1e-4


def test_streamed_pieces_carry_the_logprobs_of_their_tokens(engine):
    pieces = list(engine.stream(PROMPT, max_new_tokens=10, ignore_eos=True, logprobs=True, temperature=0.8, seed=2))
    for piece in pieces:
        assert [t.token for t in piece.logprobs] == piece.token_ids
        assert all(t.logprob <= 0 and t.top == [] for t in piece.logprobs)


def test_penalties_change_the_greedy_tokens_as_computed_by_hand(engine, eos_llama):
    """frequency_penalty on the engine against the same penalty applied by hand to transformers'
    logits at each step."""
    import torch

    model, _ = eos_llama
    ids, expected = engine.prompt_ids(PROMPT), []
    for _ in range(16):
        with torch.no_grad():
            logits = model(torch.tensor([ids + expected])).logits[0, -1].numpy().astype(np.float64)
        tokens, counts = np.unique(expected, return_counts=True) if expected else ([], [])
        for token, count in zip(tokens, counts):
            logits[token] -= 0.3 + 1.5 * count
        expected.append(int(np.argmax(logits)))
    result = engine.generate(PROMPT, max_new_tokens=16, ignore_eos=True, presence_penalty=0.3, frequency_penalty=1.5)
    assert result.token_ids == expected
    assert result.token_ids != engine.generate(PROMPT, max_new_tokens=16, ignore_eos=True).token_ids


def test_a_stop_string_inside_a_constrained_output_leaves_it_incomplete(engine):
    """The match ends with the stop string: the text the caller gets ("Paris") does not match."""
    result = engine.generate(PROMPT, choice=["Paris is"], stop=[" is"])
    assert (result.text, result.finish_reason, result.complete) == ("Paris", "stop", False)
    assert engine.generate(PROMPT, choice=["Paris is"]).complete is True


def test_a_finished_constraint_ends_without_another_pass(engine):
    """Once nothing but the end may follow, generation ends there: one graph pass per token."""
    from conftest import count_graph_runs

    runs = count_graph_runs(engine)
    result = engine.generate(PROMPT, choice=["Paris is big"])
    assert result.finish_reason == "eos" and len(result.token_ids) > 1
    assert len(runs) == len(result.token_ids)  # the prefill made the first token, each decode one more


GGUF_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    ],
}


@pytest.mark.parametrize("decoder", ["ByteLevel", "as converted from GGUF"])
def test_token_bytes_join_to_the_text_and_constraints_read_them(tmp_path, decoder):
    """Each token's bytes, read from the vocabulary, join to the text, also for the decoder
    transformers writes when it converts a GGUF tokenizer (SmolLM2's offline source), which
    llguidance's own reader takes for plain text; and a constraint accepts what the tokens spell."""
    from conftest import CORPUS, build_tokenizer

    from edgeinfer.sdk.constraints import Constraints
    from edgeinfer.sdk.manifest import TokenizerSpec
    from edgeinfer.sdk.settings import Constraint
    from edgeinfer.sdk.tokenizer import Tokenizer

    build_tokenizer().save_pretrained(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    if decoder != "ByteLevel":
        spec["decoder"] = GGUF_DECODER
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = Tokenizer(tmp_path, TokenizerSpec())
    for text in [*set(CORPUS), "a\n\tb  c", "東京 🙂 é"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(tokenizer.token_bytes(t) for t in ids) == tokenizer.decode(ids).encode() == text.encode()
    matcher = Constraints(tokenizer, 320, (EOS_ID,)).start(Constraint("regex", "[a-z ]+\n"))
    for token in tokenizer.encode("edge boxes run models\n", add_special_tokens=False):
        matcher.consume(token)
    assert matcher.is_complete and matcher.is_finished


# A schema that no finite JSON satisfies: llguidance's nesting limit makes it a dead end.
ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"], "additionalProperties": False}


def test_a_dead_end_fails_its_own_row_alone_in_the_engine_and_the_scheduler(engine):
    """One step loop (generation.py) for both: the row whose constraint dead-ends ends with finish
    reason "error" and its ConstraintError; the other rows get what they get alone. A single
    prompt, with or without speculative decoding, and a scheduled request raise the error."""
    from edgeinfer import Scheduler
    from edgeinfer.sdk.errors import ConstraintError

    endless = GenerationConfig(max_new_tokens=300, response_format=schema_format(ENDLESS))
    plain = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    alone = engine.generate("Edge boxes", plain).token_ids
    failed, other = engine.generate_batch([PROMPT, "Edge boxes"], [endless, plain])
    assert failed.finish_reason == "error" and isinstance(failed.error, ConstraintError)
    assert other.token_ids == alone and other.error is None and other.finish_reason == "length"
    for settings in ({}, {"speculative": "prompt_lookup"}):
        with pytest.raises(ConstraintError, match="cannot match the JSON schema"):
            engine.generate(PROMPT, endless, **settings)
    with Scheduler(engine, max_batch=2) as scheduler:
        doomed, fine = scheduler.submit(PROMPT, endless), scheduler.submit("Edge boxes", plain)
        assert fine.result().token_ids == alone
        with pytest.raises(ConstraintError, match="cannot match the JSON schema"):
            doomed.result()
        assert scheduler.submit("Edge boxes", plain).result().token_ids == alone  # the failed row's slot serves again
