"""Tool calls (sdk/tools.py) on a tiny random llama whose chat template is swapped for one written in
each family's format: the format read off the template, forced calls that always parse and
validate against their tool's schema (30 seeds at temperature 1.0), the generic format for a
template without tools, and the rendering of a tool turn as transformers renders it."""

import json

import jsonschema
import pytest

from edgeinfer import Engine
from edgeinfer.sdk.errors import SettingsError
from edgeinfer.sdk.tool_parser import CallParser, parse_calls
from edgeinfer.sdk.tools import GENERIC, ToolFormat, tool_format

from conftest import CHATML, EOS_ID, build_llama, build_tokenizer

# Hermes / Qwen 2.5: the tools in the system turn, each call in <tool_call> tags, results as <tool_response>.
HERMES = (
    "{%- if tools %}<|im_start|>system\nYou may call functions.\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for call in message.tool_calls %}{% if not loop.first or message.content %}{{ '\n' }}{% endif %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
# Llama 3.x: the tools in a system turn first, a call as a bare JSON object with "parameters".
LLAMA3 = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\n' }}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{%- endfor %}{%- else %}{{ message.content }}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
# Mistral: [TOOL_CALLS] then one JSON array of every call.
MISTRAL = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.tool_calls %}[TOOL_CALLS][{%- for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "{%- if not loop.last %}, {% endif %}{%- endfor %}]<|im_end|>"
    "{%- elif message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{%- else %}{{ message.content }}<|im_end|>{%- endif %}{%- endfor %}"
)
# Pythonic calls (Llama 3.2 and 4's, vLLM's "pythonic" parser): [name(key=value, ...), ...], values as JSON.
_PYTHONIC_CALLS = (
    "{%- for call in message.tool_calls %}{{ call.function.name }}("
    "{%- for key, value in call.function.arguments.items() %}{{ key }}={{ value | tojson }}{% if not loop.last %}, {% endif %}"
    "{%- endfor %}){% if not loop.last %}, {% endif %}{%- endfor %}"
)
PYTHONIC = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\n' }}"
    "{%- if message.tool_calls %}[" + _PYTHONIC_CALLS + "]{%- else %}{{ message.content }}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
# Gemma 3's function calling: pythonic calls in a tool_code block, results in a tool_output block.
GEMMA = (
    "{%- if tools %}<|im_start|>user\nYou may call: {{ tools | tojson }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.tool_calls %}<|im_start|>model\n```tool_code\n[" + _PYTHONIC_CALLS + "]\n```<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n```tool_output\n{{ message.content }}\n```<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>model\n' }}{%- endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from edgeinfer.export import export_model

    root = tmp_path_factory.mktemp("tools-llama")
    build_llama(root / "hf", eos_token_id=EOS_ID, seed=5, context=2048)
    export_model(str(root / "hf"), root / "export")
    return Engine.load(root / "export", provider="cpu")


@pytest.fixture
def with_template(engine):
    """The engine with its chat template swapped for the duration of a test."""
    own = engine.tokenizer.chat_template

    def use(template):
        engine.tokenizer.chat_template = template
        return engine

    yield use
    engine.tokenizer.chat_template = own


def test_the_format_is_read_off_each_template(with_template):
    hermes = tool_format(with_template(HERMES).tokenizer)
    assert hermes == ToolFormat("template", "<tool_call>\n", "\n</tool_call>", "\n</tool_call>\n<tool_call>\n", "arguments", False)
    assert tool_format(with_template(LLAMA3).tokenizer) == ToolFormat(
        "template", "", "", "", "parameters", False
    )  # calls back to back
    mistral = tool_format(with_template(MISTRAL).tokenizer)
    assert (mistral.opening, mistral.closing, mistral.is_list, mistral.arguments_key) == ("[TOOL_CALLS]", "", True, "arguments")
    assert tool_format(with_template(CHATML).tokenizer).name == GENERIC
    assert tool_format(with_template(PYTHONIC).tokenizer) == ToolFormat("template", "[", "]", ", ", "arguments", False, "pythonic")
    assert tool_format(with_template(GEMMA).tokenizer) == ToolFormat(
        "template", "```tool_code\n[", "]\n```", ", ", "arguments", False, "pythonic"
    )


def validate(call):
    assert call.name in SCHEMAS and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


ALL = [HERMES, LLAMA3, MISTRAL, PYTHONIC, GEMMA, CHATML]
ALL_IDS = ["hermes", "llama3", "mistral", "pythonic", "gemma", "generic"]


@pytest.mark.parametrize("template", ALL, ids=ALL_IDS)
def test_required_calls_parse_and_validate_for_every_seed(with_template, template):
    engine = with_template(template)
    arguments = set()
    for seed in range(30):
        result = engine.chat(
            ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed, max_new_tokens=200
        )
        assert result.finish_reason == "tool_calls" and len(result.tool_calls) == 1, (seed, result.text, result.finish_reason)
        for call in result.tool_calls:
            validate(call)
            arguments.add(call.arguments)
        assert result.tool_format == ("generic" if template is CHATML else "template")
    assert len(arguments) > 10  # the seeds really sampled (which tool is the model's pick: the named-tool test forces each)


@pytest.mark.parametrize(
    "template", [HERMES, MISTRAL, PYTHONIC, GEMMA, CHATML], ids=["hermes", "mistral", "pythonic", "gemma", "generic"]
)
def test_parallel_calls_that_end_are_each_valid(with_template, template):
    """With parallel calls a random model may keep calling until the budget ends the turn ("length":
    the whole calls made so far, each valid; the one it ended inside is `cut_tool_call`); every turn
    that ends by itself holds one or more valid calls."""
    engine = with_template(template)
    ended = 0
    for seed in range(10):
        result = engine.chat(
            ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=True, temperature=1.0, seed=seed, max_new_tokens=200
        )
        if result.finish_reason == "length":
            for call in result.tool_calls:
                validate(call)
            assert result.cut_tool_call is None or result.cut_tool_call.id not in {c.id for c in result.tool_calls}
            continue
        assert result.cut_tool_call is None
        ended += 1
        assert result.finish_reason == "tool_calls" and result.tool_calls
        for call in result.tool_calls:
            validate(call)
    assert ended >= 3


@pytest.mark.parametrize(
    "template", [HERMES, MISTRAL, PYTHONIC, GEMMA, CHATML], ids=["hermes", "mistral", "pythonic", "gemma", "generic"]
)
def test_a_named_tool_is_the_one_called_and_once_without_parallel_calls(with_template, template):
    engine = with_template(template)
    choice = {"type": "function", "function": {"name": "add"}}
    for seed in range(10):
        result = engine.chat(
            ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, temperature=1.0, seed=seed, max_new_tokens=200
        )
        assert [c.name for c in result.tool_calls] == ["add"], result.text
        validate(result.tool_calls[0])


def test_auto_on_the_generic_format_is_a_reply_or_valid_calls(with_template):
    engine = with_template(CHATML)
    kinds = set()
    for seed in range(12):
        result = engine.chat(ASK, tools=TOOLS, temperature=1.0, seed=seed, max_new_tokens=200)
        if result.finish_reason == "length":  # cut short: the whole calls so far, the one it ended inside left out
            assert result.text == "" or not result.tool_calls
            for call in result.tool_calls:
                validate(call)
        elif result.tool_calls:
            kinds.add("call")
            assert result.finish_reason == "tool_calls" and result.text == ""
            for call in result.tool_calls:
                validate(call)
        else:
            kinds.add("reply")
            assert not result.text.startswith('{"')  # the reply's text, out of its JSON
    assert kinds  # at least one turn ended within the budget


def test_the_generic_format_describes_the_tools_and_none_leaves_them_out(with_template):
    engine = with_template(CHATML)
    from edgeinfer.sdk.tools import plan, tool_request

    forced = plan(engine.tokenizer, ASK, tool_request(TOOLS, "required"))
    assert forced.messages[0]["role"] == "system" and '"get_weather"' in forced.messages[0]["content"]
    assert '"response"' not in forced.messages[0]["content"] and forced.response_format["type"] == "json_schema"
    none = plan(engine.tokenizer, ASK, tool_request(TOOLS, "none"))
    assert none.messages == ASK and none.response_format is None
    result = engine.chat(ASK, tools=TOOLS, tool_choice="none", max_new_tokens=5)
    assert result.tool_calls == [] and result.finish_reason != "tool_calls"


def test_a_tool_turn_renders_as_transformers_renders_it(with_template):
    engine = with_template(HERMES)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = HERMES
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    theirs = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    as_sent = [
        *messages[:1],
        {**messages[1], "tool_calls": [{**call, "function": {**call["function"], "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    ]
    ours = engine.tokenizer.render_chat([*as_sent, messages[2]], tools=TOOLS)  # OpenAI sends the arguments as JSON text
    assert ours == theirs and "<tool_response>" in ours and '"arguments": {"city": "Paris"' in ours
    ids = engine.tokenizer.chat_ids([*as_sent, messages[2]], tools=TOOLS)
    assert ids == tokenizer(theirs, add_special_tokens=False).input_ids


@pytest.mark.parametrize(
    "format, text, content, calls",
    [
        (
            ToolFormat("template", "<tool_call>\n", "\n</tool_call>", "\n</tool_call>\n<tool_call>\n"),
            'Let me look.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": true}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>',
            "Let me look.",
            [("add", {"a": 1, "b": True}), ("get_weather", {"city": "Oslo", "unit": "c"})],
        ),
        (
            ToolFormat("template", "", "", None, "parameters"),
            '{"name": "add", "parameters": {"a": 2, "b": false}}',
            "",
            [("add", {"a": 2, "b": False})],
        ),
        (
            ToolFormat("template", "[TOOL_CALLS]", "", None, is_list=True),
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3, "b": true}}]',
            "",
            [("add", {"a": 3, "b": True})],
        ),
        (
            ToolFormat(GENERIC),
            '{"tool_calls": [{"name": "add", "arguments": {"a": 4, "b": true}}]}',
            "",
            [("add", {"a": 4, "b": True})],
        ),
        (ToolFormat(GENERIC), '{"response": "It is sunny."}', "It is sunny.", []),
        (ToolFormat("template", "<tool_call>\n", "\n</tool_call>"), "No call here.", "No call here.", []),
        (
            ToolFormat("template", "<tool_call>\n", "\n</tool_call>"),
            '<tool_call>\n{"argum',
            '<tool_call>\n{"argum',
            [],
        ),
    ],
)
def test_calls_parse_out_of_each_format(format, text, content, calls):
    got_content, got = parse_calls(text, format)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got)


def test_a_call_cut_short_is_no_call_and_the_parser_says_how_far_it_came():
    """A call the reply ended inside is not among the calls (its arguments are no JSON); `cut_call`
    has it as a stream would have sent it: the name once whole, the arguments as far as they came."""
    text = 'Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b'
    content, calls = parse_calls(text, ToolFormat("template", "<tool_call>\n", "\n</tool_call>", "\n"))
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1}')]
    parser = CallParser(ToolFormat("template", "<tool_call>\n", "\n</tool_call>", "\n"))
    parser.feed(text)
    parser.finish()
    assert (parser.cut_call.name, parser.cut_call.arguments) == ("add", '{"a": 1, "b')
    parser = CallParser(ToolFormat("template", "<tool_call>\n", "\n</tool_call>", "\n"))
    parser.feed(text[: text.index("\n<tool_call>", 20)])
    assert parser.cut_call is None and len(parser.tool_calls) == 1  # a whole call, the closing marker not yet come
    content, calls = parse_calls('{"arguments": {"a": 2}, "name": "add"}', ToolFormat("template", arguments_key="arguments"))
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 2}')]  # arguments before the name
    content, calls = parse_calls('{"name": "now"}', ToolFormat("template"))
    assert [(c.name, c.arguments) for c in calls] == [("now", "{}")]
    content, calls = parse_calls('{"name": "add", "arguments": "{\\"a\\": \\"\\u00e9\\ud83d\\ude00\\"}"}', ToolFormat("template"))
    assert [(c.name, c.arguments) for c in calls] == [("add", '{"a": "é😀"}')]  # arguments given as JSON text


def test_bad_tools_are_settings_errors_naming_the_parameter(with_template):
    engine = with_template(HERMES)
    cases = [
        (dict(tools=[]), "tools"),
        (dict(tools=[{"type": "function"}]), "tools[0]"),
        (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name"),
        (dict(tools=[WEATHER, WEATHER]), "tools"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="always"), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required", choice=["a"]), "response_format"),
        (dict(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls"),
    ]
    for kwargs, param in cases:
        with pytest.raises(SettingsError) as raised:
            engine.chat(ASK, max_new_tokens=4, **kwargs)
        assert raised.value.param == param, (kwargs, raised.value)
    with pytest.raises(SettingsError, match="^response_format and choice cannot constrain a turn that must call"):
        engine.chat(ASK, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})  # the server's words too


def test_the_cli_runs_a_chat_turn_with_tools(engine, tmp_path):
    import subprocess
    import sys

    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    base = [
        sys.executable,
        "-m",
        "edgeinfer.cli",
        "run",
        "--model",
        str(engine.folder),
        "--provider",
        "cpu",
    ]  # a chat turn: the default
    flags = ["--tools", str(tools), "--tool-choice", "add", "--temperature", "1", "--seed", "3", "--max-new-tokens", "200"]
    done = subprocess.run([*base, *flags, "Add two numbers"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    call = json.loads(done.stdout.strip().splitlines()[-1])  # the template is ChatML's: the generic format
    assert call["name"] == "add" and "tool format: generic" in done.stderr
    jsonschema.validate(call["arguments"], SCHEMAS["add"])
    done = subprocess.run([*base, *flags, "--json", "Add two numbers"], capture_output=True, text=True, timeout=300)
    result = json.loads(done.stdout)
    assert result["finish_reason"] == "tool_calls" and [c["name"] for c in result["tool_calls"]] == ["add"]  # one call, as asked
    done = subprocess.run(
        [*base, *flags, "--parallel-tool-calls", "--json", "Add two numbers"], capture_output=True, text=True, timeout=300
    )
    assert json.loads(done.stdout)["finish_reason"] == "tool_calls"
    cut = [*flags[:-1], "30"]  # the generic format's call opened ({"tool_calls": [{"name": "add", ...), not ended
    done = subprocess.run([*base, *cut, "Add two numbers"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "the reply ended inside a call to add, not printed" in done.stderr, done.stderr
    assert '"name": "add"' not in done.stdout and "finish: length" in done.stderr
    done = subprocess.run([*base, "--raw", "--tools", str(tools), "hi"], capture_output=True, text=True, timeout=300)
    assert (
        done.returncode == 2
        and "--tools, --tool-choice and --parallel-tool-calls apply to a chat turn: leave out --raw" in done.stderr
    )


def sample_under(engine, grammar: str, start: str, seed: int, steps: int = 300) -> str:
    """Text that begins with `start` and goes on with tokens drawn uniformly from those the grammar
    allows, until it may only end: what any model would be held to."""
    import numpy as np

    from edgeinfer.sdk.settings import Constraint

    matcher, rng = engine.constraints.start(Constraint("lark", grammar)), np.random.default_rng(seed)
    ids = engine.tokenizer.encode(start, False)
    for token in ids:
        matcher.consume(token)
    eos = set(engine.manifest.eos_token_ids)
    for _ in range(steps):
        allowed = [t for t in matcher.allowed().nonzero()[0] if t not in eos]
        if matcher.is_finished or not allowed:
            break
        token = int(rng.choice(allowed))
        matcher.consume(token)
        ids.append(token)
    assert matcher.is_complete, engine.tokenizer.decode_all(ids)
    return engine.tokenizer.decode_all(ids)


@pytest.mark.parametrize(
    "template, opened",
    [
        (HERMES, "Let me check.\n<tool_call>\n"),
        (MISTRAL, "[TOOL_CALLS]"),
        (LLAMA3, "{"),
        (PYTHONIC, "["),
        (GEMMA, "Checking. ```tool_code\n["),
    ],
)
def test_with_auto_a_call_the_model_opens_always_ends_valid(with_template, template, opened):
    """tool_choice auto: the text is free, but once the output opens a call, only a valid call
    (and then the format's end) may follow, whatever tokens are drawn."""
    from edgeinfer.sdk.tools import plan, tool_request

    engine = with_template(template)
    chosen = plan(engine.tokenizer, ASK, tool_request(TOOLS, "auto", parallel_tool_calls=False))
    grammar, format = chosen.response_format["lark"], chosen.format
    for seed in range(15):
        text = sample_under(engine, grammar, opened, seed)
        content, calls = parse_calls(text, format)
        assert len(calls) == 1, text
        validate(calls[0])
    free = sample_under(engine, grammar, "It is sunny in Paris.", 0, steps=0)  # plain text may end there
    assert parse_calls(free, format) == ("It is sunny in Paris.", [])


def test_a_calls_arguments_hold_the_declared_properties_unless_the_schema_allows_more():
    from edgeinfer.sdk.tool_syntax.schema import call_schema
    from edgeinfer.sdk.tools import tool_request

    open_tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    }
    schema = call_schema(tool_request([open_tool], "required"))
    assert schema["properties"]["arguments"]["additionalProperties"] is False
    allowing = json.loads(json.dumps(open_tool))
    allowing["function"]["parameters"]["additionalProperties"] = True
    assert call_schema(tool_request([allowing], "required"))["properties"]["arguments"]["additionalProperties"] is True


# The parameters pydantic writes for a tool: the nested model under $defs, referred to from a property.
PYDANTIC_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "$defs": {
                "Loc": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
                    "required": ["city", "unit"],
                    "additionalProperties": False,
                    "title": "Loc",
                }
            },
            "type": "object",
            "properties": {"where": {"$ref": "#/$defs/Loc"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["where", "days"],
            "title": "GetWeather",
        },
    },
}


@pytest.mark.parametrize("template", ALL, ids=ALL_IDS)
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_tool_parameters_with_defs_and_refs_constrain_the_call_on_every_format(with_template, template, choice):
    """References within a tool's parameters are resolved against the parameters the client sent,
    wherever the call's grammar nests them; every call made is valid for them."""
    engine = with_template(template)
    schema = PYDANTIC_TOOL["function"]["parameters"]
    calls = 0
    for seed in range(6):
        result = engine.chat(
            ASK, tools=[PYDANTIC_TOOL], tool_choice=choice, parallel_tool_calls=False, temperature=1.0, seed=seed, max_new_tokens=160
        )
        for call in result.tool_calls:
            arguments = json.loads(call.arguments)
            jsonschema.validate(arguments, schema)
            assert set(arguments["where"]) == {"city", "unit"}
            calls += 1
    assert calls >= (6 if choice == "required" else 0)


def test_a_results_tool_calls_go_back_into_the_conversation_as_they_came(with_template):
    """result.tool_calls (ToolCall objects) sent back in the assistant's message, with the tool's
    result after it: the same turn as the calls in OpenAI's dict shape."""
    from edgeinfer.sdk.chat import chat_turn
    from edgeinfer.sdk.tools import tool_request

    engine = with_template(HERMES)
    first = engine.chat(ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_new_tokens=160)
    assert len(first.tool_calls) == 1
    answer = {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "18 C, sunny"}
    sent = [*ASK, {"role": "assistant", "content": first.text, "tool_calls": first.tool_calls}, answer]
    as_dicts = [*ASK, {"role": "assistant", "content": first.text, "tool_calls": [c.as_openai() for c in first.tool_calls]}, answer]
    request = tool_request(TOOLS)
    turn = chat_turn(engine.tokenizer, engine.max_context, sent, request)
    assert turn.ids == chat_turn(engine.tokenizer, engine.max_context, as_dicts, request).ids
    assert first.tool_calls[0].name in turn.text and "18 C, sunny" in turn.text
    assert engine.chat(sent, tools=TOOLS, max_new_tokens=6).token_ids == engine.chat(as_dicts, tools=TOOLS, max_new_tokens=6).token_ids
