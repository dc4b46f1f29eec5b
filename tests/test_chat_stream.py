"""A chat turn as it streams (sdk/chat_stream.py, sdk/tool_parser.py): tool calls read out as they
are generated (the name first, then the arguments in pieces), in every cut of a reply the same as
the whole; `stream_chat`'s deltas joined give `chat`'s result on the tiny llama in each family's
format; a call marker that is a special token; a reasoning model's thought ended by its budget."""

import json
from pathlib import Path

import jsonschema
import pytest
from test_reasoning import THINKING
from test_tools import ASK, GEMMA, HERMES, LLAMA3, MISTRAL, PYTHONIC, SCHEMAS, TOOLS, engine, sample_under, with_template  # noqa: F401

from edgeinfer import Engine
from edgeinfer.sdk.errors import SettingsError
from edgeinfer.sdk.chat_stream import said
from edgeinfer.sdk.tool_parser import CallArguments, CallOpened, CallParser, Said, parse_calls
from edgeinfer.sdk.tools import GENERIC, ToolFormat, plan, tool_format, tool_request

from conftest import CHATML, EOS_ID, build_llama

HERMES_FORMAT = ToolFormat("template", "<tool_call>\n", "\n</tool_call>", "\n</tool_call>\n<tool_call>\n")
REPLIES = [
    (
        HERMES_FORMAT,
        'Let me look.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "x}{\\"y"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>',
    ),
    (
        ToolFormat("template", "[TOOL_CALLS]", is_list=True),
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3}}, {"name": "f", "arguments": []}]',
    ),
    (ToolFormat("template", arguments_key="parameters"), '{"name": "add", "parameters": {"a": -1.5e3, "b": [true, null]}}'),
    (ToolFormat(GENERIC), '{"tool_calls": [{"name": "add", "arguments": {"a": 4}}, {"name": "g", "arguments": {}}]}'),
    (ToolFormat(GENERIC), '{"response": "It is \\"sunny\\"\\n\\u00e9\\ud83d\\ude00 here."}'),
    (
        ToolFormat("template", "[", "]", ", ", syntax="pythonic"),
        '[add(a=1, b="x)(\\"y"), get_weather(city=\'Os\\\'lo\', unit="c", n=True, m=None, k=[1, {"z": 2}]), now()]',
    ),
    (ToolFormat("template", "```tool_code\n[", "]\n```", ", ", syntax="pythonic"), "Checking.\n```tool_code\n[add(a=-2.5)]\n```"),
    (ToolFormat("template", "[", "]", ", ", syntax="pythonic"), "[not a call, only text] and more."),
    (HERMES_FORMAT, "No call, only <tool text and a { brace."),
    (HERMES_FORMAT, "<tool_call>\n{not a call}"),
]


def joined(parts: list) -> tuple[str, list]:
    """(text, [(id, name, arguments)]) of a stream's parts, as a client accumulates them."""
    calls = {}
    for part in parts:
        if isinstance(part, CallOpened):
            assert part.index not in calls and part.index == len(calls)  # each call opens once, in order
            calls[part.index] = [part.id, part.name, ""]
        elif isinstance(part, CallArguments):
            calls[part.index][2] += part.text  # a call's arguments come after its name
        else:
            assert isinstance(part, Said) and part.kind in ("text", "reasoning")
    return said(parts, "text"), [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("format, reply", REPLIES)
def test_every_cut_of_a_reply_gives_the_whole_parse(format, reply):
    content, calls = parse_calls(reply, format)
    whole = (content, [(c.name, c.arguments) for c in calls])
    for first in range(len(reply) + 1):
        for second in range(first, len(reply) + 1, 7):
            parser = CallParser(format)
            parts = [p for chunk in (reply[:first], reply[first:second], reply[second:]) for p in parser.feed(chunk)]
            text, streamed = joined(parts + parser.finish())
            assert (text, [(name, arguments) for _, name, arguments in streamed]) == whole, (first, second, parts)


def test_the_parse_of_each_reply():
    got = [parse_calls(reply, format) for format, reply in REPLIES]
    named = [(text, [(c.name, json.loads(c.arguments)) for c in calls]) for text, calls in got]
    assert named[0] == ("Let me look.", [("add", {"a": 1, "b": 'x}{"y'}), ("get_weather", {"city": "Oslo", "unit": "c"})])
    assert named[1] == ("", [("add", {"a": 3}), ("f", [])])
    assert named[2] == ("", [("add", {"a": -1500.0, "b": [True, None]})])
    assert named[3] == ("", [("add", {"a": 4}), ("g", {})])
    assert named[4] == ('It is "sunny"\né😀 here.', [])
    weather = {"city": "Os'lo", "unit": "c", "n": True, "m": None, "k": [1, {"z": 2}]}
    assert named[5] == ("", [("add", {"a": 1, "b": 'x)("y'}), ("get_weather", weather), ("now", {})])
    assert named[6] == ("Checking.", [("add", {"a": -2.5})])
    assert named[7] == ("[not a call, only text] and more.", [])
    assert named[8] == ("No call, only <tool text and a { brace.", [])
    assert named[9] == ("<tool_call>\n{not a call}", [])  # a marker that opens no call stays text


def test_arguments_are_said_as_they_come():
    parser = CallParser(HERMES_FORMAT)
    reply = '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": "xyz"}}\n</tool_call>'
    parts = [p for c in reply for p in parser.feed(c)]  # a character at a time
    assert isinstance(parts[0], CallOpened) and parts[0].name == "add"
    pieces = [p.text for p in parts if isinstance(p, CallArguments)]
    assert len(pieces) == len('{"a": 12, "b": "xyz"}') and "".join(pieces) == '{"a": 12, "b": "xyz"}'


@pytest.mark.parametrize(
    "template", [HERMES, MISTRAL, LLAMA3, PYTHONIC, GEMMA, CHATML], ids=["hermes", "mistral", "llama3", "pythonic", "gemma", "generic"]
)
def test_stream_chat_joins_to_chat(with_template, template):
    """Forced calls sampled at temperature 1.0: the stream's calls open with their id and name and
    their arguments arrive in pieces, and everything joined is what chat returns."""
    engine = with_template(template)
    pieces = 0
    for seed in range(5):
        asked = dict(tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_new_tokens=200)
        whole = engine.chat(ASK, **asked)
        deltas = list(engine.stream_chat(ASK, **asked))
        text, calls = joined([p for d in deltas for p in d.parts])
        last = deltas[-1].result
        assert (text, [(n, a) for _, n, a in calls]) == (whole.text, [(c.name, c.arguments) for c in whole.tool_calls])
        assert [c.id for c in last.tool_calls] == [i for i, _, _ in calls] and all(i.startswith("call_") for i, _, _ in calls)
        assert last.finish_reason == whole.finish_reason and last.token_ids == whole.token_ids
        assert [t for d in deltas for t in d.token_ids] == whole.token_ids
        pieces = max(
            pieces, max(sum(isinstance(p, CallArguments) and p.index == i for d in deltas for p in d.parts) for i in range(len(calls)))
        )
        if whole.finish_reason == "tool_calls":
            for call in whole.tool_calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert pieces >= 3  # the arguments are streamed as generated, not sent whole at the end


@pytest.fixture(scope="module")
def special(tmp_path_factory):
    """The tiny llama whose tokenizer has Mistral's [TOOL_CALLS] as a special token, as Mistral's has."""
    from transformers import AutoTokenizer

    from edgeinfer.export import export_model

    root = Path(tmp_path_factory.mktemp("special-marker"))
    build_llama(root / "hf", eos_token_id=EOS_ID, seed=5, context=2048)
    tokenizer = AutoTokenizer.from_pretrained(root / "hf")
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tokenizer.chat_template = MISTRAL
    tokenizer.save_pretrained(root / "hf")
    export_model(str(root / "hf"), root / "export")
    return Engine.load(root / "export", provider="cpu")


def test_a_marker_that_is_a_special_token_opens_calls_forced_and_auto(special):
    marker = special.tokenizer.special_tokens["[TOOL_CALLS]"]
    format = tool_format(special.tokenizer)
    assert (format.opening, format.is_list) == ("[TOOL_CALLS]", True)
    for seed in range(6):
        result = special.chat(ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, max_new_tokens=200)
        assert result.token_ids[0] == marker and result.text == "" and result.tool_calls
        if result.finish_reason == "tool_calls":
            for call in result.tool_calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    grammar = plan(special.tokenizer, ASK, tool_request(TOOLS, "auto", parallel_tool_calls=False)).response_format["lark"]
    assert f"<[^{marker}]>" in grammar  # text is any token but the marker; the marker opens a constrained call
    for seed in range(8):
        text = sample_under(special, grammar, "It is sunny. [TOOL_CALLS]", seed)
        content, calls = parse_calls(text, format)
        assert content == "It is sunny." and len(calls) == 1, text
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])


def test_auto_turns_with_a_special_marker_stream_as_they_end(special):
    for seed in range(4):
        asked = dict(tools=TOOLS, temperature=1.0, seed=seed, max_new_tokens=60)
        whole = special.chat(ASK, **asked)
        deltas = list(special.stream_chat(ASK, **asked))
        text, calls = joined([p for d in deltas for p in d.parts])
        assert (text, [(n, a) for _, n, a in calls]) == (whole.text, [(c.name, c.arguments) for c in whole.tool_calls])
        assert "[TOOL_CALLS]" not in text and "<|im_end|>" not in text


# A template whose generation prompt opens the thought (the DeepSeek-R1 distills' and QwQ's way).
OPENED = THINKING.replace("{{ '<|im_start|>assistant\n' }}", "{{ '<|im_start|>assistant\n<think>\n' }}", 1)


def closed_at(ids: list[int], closing: list[int]) -> int:
    """Where the closing marker's tokens start in `ids`."""
    return next(i for i in range(len(ids)) if ids[i : i + len(closing)] == closing)


def test_the_thought_ends_after_its_budget(with_template):
    engine = with_template(OPENED)
    closing = engine.tokenizer.encode("</think>", False)
    for budget in (0, 1, 6, 12):
        result = engine.chat(ASK, reasoning_budget=budget, max_new_tokens=30, temperature=1.0, seed=budget)
        at = closed_at(result.token_ids, closing)
        thought = engine.tokenizer.decode(result.token_ids[:at])
        # the closing comes at the first character's end from the budget on (a byte-level token may hold part of one)
        assert budget <= at <= budget + 3 and "\ufffd" not in thought[-1:], engine.tokenizer.decode_all(result.token_ids)
        assert at == budget or "\ufffd" in engine.tokenizer.decode(result.token_ids[:budget])[-1:]
        assert result.reasoning == thought.lstrip("\n") and result.reasoning_tokens == at + len(closing)
        assert "</think>" not in result.text and result.finish_reason in ("eos", "length")
    free = engine.chat(ASK, max_new_tokens=30, temperature=1.0, seed=6)
    assert free.token_ids[:6] == engine.chat(ASK, reasoning_budget=6, max_new_tokens=30, temperature=1.0, seed=6).token_ids[:6]
    streamed = list(engine.stream_chat(ASK, reasoning_budget=6, max_new_tokens=30, temperature=1.0, seed=6))
    assert "".join(d.reasoning for d in streamed) == streamed[-1].result.reasoning
    assert "".join(d.text for d in streamed) == streamed[-1].result.text


def test_a_budget_on_a_model_that_does_not_think_is_refused(with_template):
    engine = with_template(CHATML)
    with pytest.raises(SettingsError) as raised:
        engine.chat(ASK, reasoning_budget=5)
    assert raised.value.param == "reasoning_budget" and "<think>" in str(raised.value)
    with pytest.raises(SettingsError) as raised:
        with_template(OPENED).chat(ASK, reasoning_budget=-1)
    assert raised.value.param == "reasoning_budget"


# SmolLM3's way: Hermes calls, and a thought the generation prompt opens.
THINKING_HERMES = HERMES.replace("{{ '<|im_start|>assistant\n' }}", "{{ '<|im_start|>assistant\n<think>\n' }}")
assert THINKING_HERMES != HERMES


def test_a_reasoning_model_thinks_then_makes_a_valid_forced_call(with_template):
    """The forced call's grammar lets the thought come first; its budget ends it, and the call
    that follows is valid, in chat and in stream_chat alike."""
    engine = with_template(THINKING_HERMES)
    closing = engine.tokenizer.encode("</think>", False)
    for seed in range(6):
        asked = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed, max_new_tokens=200)
        result = engine.chat(ASK, reasoning_budget=8, **asked)
        assert 8 <= closed_at(result.token_ids, closing) <= 11 and result.reasoning
        assert result.finish_reason == "tool_calls" and len(result.tool_calls) == 1, engine.tokenizer.decode_all(result.token_ids)
        jsonschema.validate(json.loads(result.tool_calls[0].arguments), SCHEMAS[result.tool_calls[0].name])
        deltas = list(engine.stream_chat(ASK, reasoning_budget=8, **asked))
        assert "".join(d.reasoning for d in deltas) == result.reasoning
        assert [(n, a) for _, n, a in joined([p for d in deltas for p in d.parts])[1]] == [
            (c.name, c.arguments) for c in result.tool_calls
        ]


def test_the_terminal_chat_shows_the_thought_apart_from_the_reply(tmp_path):
    """`edgeinfer chat` on a model whose prompt opens the thought: the thought (ended by
    --reasoning-budget) on stderr, the reply alone on stdout and in the conversation."""
    import subprocess
    import sys

    from test_serve_tools import tool_export

    export = tool_export(tmp_path, OPENED)
    engine = Engine.load(export, provider="cpu")
    seed = next(s for s in range(20) if engine.chat(ASK, reasoning_budget=3, max_new_tokens=12, temperature=1.0, seed=s).text.strip())
    expected = engine.chat(ASK, reasoning_budget=3, max_new_tokens=12, temperature=1.0, seed=seed)
    flags = ["--max-new-tokens", "12", "--reasoning-budget", "3", "--temperature", "1", "--seed", str(seed)]
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "chat", "--model", str(export), *flags],
        input=ASK[0]["content"] + "\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    said = lambda text: text.replace("\r\n", "\n").replace("\r", "\n")  # noqa: E731 - as text mode reads it
    assert done.stdout == said(expected.text) + "\n" and said(expected.reasoning) in done.stderr
    assert "</think>" not in done.stdout
