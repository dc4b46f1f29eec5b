"""Anthropic's Messages API through `edgeinfer serve`, driven by the real `anthropic` client: the
same tokens as the SDK for the same conversation, whole and streamed, tool_use blocks valid for
their tool's input_schema, a tool_result turn, count_tokens, x-api-key, and errors in Anthropic's
shape."""

import json
import signal

import anthropic
import httpx
import jsonschema
import pytest
from test_serve import start
from test_serve_tools import tool_export
from test_tools import HERMES, SCHEMAS, TOOLS

from edgeinfer import Engine

KEY = "anthropic-key"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS_ANTHROPIC = [
    {"name": t["function"]["name"], "description": t["function"].get("description", ""), "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    export = tool_export(tmp_path_factory.mktemp("serve-anthropic"), HERMES)
    process, url = start(export, "--provider", "cpu", "--max-batch", "2", "--api-key", KEY)
    yield url, export, anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def engine(served):
    return Engine.load(served[1], provider="cpu")


def test_a_reply_is_the_sdks_whole_and_streamed(served, engine):
    _, export, client = served
    system = "Be brief."
    message = client.messages.create(model=export.name, max_tokens=12, system=system, messages=ASK)
    expected = engine.chat([{"role": "system", "content": system}, *ASK], max_new_tokens=12)
    assert message.type == "message" and message.role == "assistant" and message.model == export.name
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == expected.text
    assert message.stop_reason == {"length": "max_tokens", "eos": "end_turn"}[expected.finish_reason]
    assert message.usage.input_tokens == expected.prompt_tokens and message.usage.output_tokens == len(expected.token_ids)
    with client.messages.stream(model=export.name, max_tokens=12, system=system, messages=ASK) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == expected.text == final.content[0].text and len(texts) >= 2
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == len(expected.token_ids)


def test_tool_use_blocks_validate_whole_and_streamed(served):
    _, export, client = served
    for seed in range(4):
        asked = dict(
            model=export.name, max_tokens=200, messages=ASK, tools=TOOLS_ANTHROPIC, extra_body={"temperature": 1.0, "seed": seed}
        )
        asked["tool_choice"] = {"type": "any", "disable_parallel_tool_use": True}
        message = client.messages.create(**asked, metadata={"user_id": f"seed-{seed}"})
        assert message.stop_reason == "tool_use"
        uses = [b for b in message.content if b.type == "tool_use"]
        assert len(uses) == 1 and uses[0].id.startswith("toolu_")
        jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])
    again = client.messages.create(**asked)  # edgeinfer's seed: the same request, the same call
    assert [(b.name, b.input) for b in again.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    asked["tool_choice"] = {"type": "tool", "name": "add"}
    with client.messages.stream(**asked) as stream:
        kinds = [event.type == "content_block_delta" and event.delta.type for event in stream]
        final = stream.get_final_message()
    assert kinds.count("input_json_delta") >= 3  # the input in pieces, as generated
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and uses and all(u.name == "add" for u in uses)
    for use in uses:
        jsonschema.validate(use.input, SCHEMAS["add"])


def test_a_tool_result_turn_and_count_tokens(served, engine):
    _, export, client = served
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 degrees"}]},
    ]
    message = client.messages.create(
        model=export.name, max_tokens=6, messages=history, tools=TOOLS_ANTHROPIC, tool_choice={"type": "none"}
    )
    assert message.content[0].type == "text"
    as_openai = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21 degrees"},
    ]
    counted = client.messages.count_tokens(model=export.name, messages=history, tools=TOOLS_ANTHROPIC)
    assert counted.input_tokens == len(engine.tokenizer.chat_ids(as_openai, tools=TOOLS))
    assert message.usage.input_tokens == len(engine.tokenizer.chat_ids(as_openai))  # tool_choice none leaves the tools out


def test_errors_come_in_anthropics_shape(served):
    url, export, client = served
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(
            model=export.name, max_tokens=4, messages=ASK, tools=TOOLS_ANTHROPIC, tool_choice={"type": "tool", "name": "nope"}
        )
    assert raised.value.body["type"] == "error" and raised.value.body["error"]["type"] == "invalid_request_error"
    assert "names no tool" in raised.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-other", max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.AuthenticationError) as raised:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=export.name, max_tokens=4, messages=ASK
        )
    assert raised.value.body["error"]["type"] == "authentication_error"
    for body in ({"model": export.name, "messages": ASK}, {"model": export.name, "max_tokens": 4, "messages": ASK, "bogus": 1}):
        response = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": KEY})
        error = response.json()
        assert response.status_code == 400 and error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert json.loads(httpx.post(f"{url}/v1/chat/completions", json={}, headers={"x-api-key": KEY}).text)["error"]["param"] == "model"
