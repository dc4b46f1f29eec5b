"""Tool calls through `edgeinfer serve` and the real openai client: a tiny llama exported with a
Hermes-format chat template, and one with ChatML (no tools: the generic format). Forced calls come
back in OpenAI's shape and validate against their tool's schema, whole and streamed (the client's
stream helper accumulates the same calls), and a tool result turn is accepted."""

import json
import signal

import httpx
import jsonschema
import openai
import pytest
from test_serve import start
from test_tools import HERMES, SCHEMAS, TOOLS

from conftest import EOS_ID, build_llama

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def tool_export(root, template: str | None):
    from transformers import AutoTokenizer

    from edgeinfer.export import export_model

    build_llama(root / "hf", eos_token_id=EOS_ID, seed=5, context=2048)
    if template is not None:
        tokenizer = AutoTokenizer.from_pretrained(root / "hf")
        tokenizer.chat_template = template
        tokenizer.save_pretrained(root / "hf")
    export_model(str(root / "hf"), root / "export")
    return root / "export"


@pytest.fixture(scope="module", params=["hermes", "generic"])
def served(request, tmp_path_factory):
    export = tool_export(tmp_path_factory.mktemp(f"serve-tools-{request.param}"), HERMES if request.param == "hermes" else None)
    process, url = start(export, "--provider", "cpu", "--max-batch", "2")
    yield request.param, url, export.name, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), export
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


def validate(call):
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_required_call_comes_back_in_openais_shape(served):
    _, _, model, client, _ = served
    for seed in range(5):
        reply = client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) >= 1
        for call in choice.message.tool_calls:
            validate(call)


def test_the_stream_helper_accumulates_the_same_calls(served):
    _, _, model, client, _ = served
    asked = dict(model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=7, max_tokens=200)
    asked["tool_choice"] = {"type": "function", "function": {"name": "add"}}
    whole = client.chat.completions.create(**asked).choices[0].message.tool_calls
    with client.chat.completions.stream(**asked) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    streamed = [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls]
    assert streamed == [(c.function.name, json.loads(c.function.arguments)) for c in whole] and streamed[0][0] == "add"
    for call in final.message.tool_calls:
        validate(call)
    raw = [
        c.choices[0].delta.tool_calls[0] for c in client.chat.completions.create(**asked, stream=True) if c.choices[0].delta.tool_calls
    ]
    assert raw[0].id.startswith("call_") and raw[0].function.name == "add" and raw[0].function.arguments == ""
    opened = [d.index for d in raw if d.id is not None]
    assert opened == list(range(len(whole))) and all(d.function.name is None for d in raw if d.id is None)
    assert len(raw) >= 3 * len(whole)  # each call's arguments in pieces, as generated
    assert "".join(d.function.arguments for d in raw if d.index == 0) == whole[0].function.arguments


def test_calls_as_rows_of_one_batch_each_validate_whole_and_streamed(served):
    """n choices run as rows of the scheduler's batch (--max-batch 2), each held to its own grammar
    and read by its own parser, whole and streamed."""
    _, _, model, client, _ = served
    asked = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0)
    reply = client.chat.completions.create(**asked, n=6, seed=11, max_tokens=200)
    assert len(reply.choices) == 6 and len({c.message.tool_calls[0].function.arguments for c in reply.choices}) > 1
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        validate(choice.message.tool_calls[0])
    calls = {}
    for chunk in client.chat.completions.create(**asked, n=3, seed=12, max_tokens=200, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    calls[choice.index] = [delta.id, delta.function.name, ""]
                calls[choice.index][2] += delta.function.arguments
    assert sorted(calls) == [0, 1, 2] and len({c[0] for c in calls.values()}) == 3
    for call_id, name, arguments in calls.values():
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_tool_result_turn_is_answered(served):
    _, _, model, client, _ = served
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
    ]
    reply = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason in ("stop", "length")


def test_a_call_cut_by_the_token_limit_is_no_call_and_every_api_says_so(served):
    """max_tokens that ends the reply inside the forced call (its name whole, its arguments not):
    no call is returned as one; the reply ends with the APIs' "length" and says which call was cut,
    whole and streamed: chat completions' choice `cut_tool_call`, Responses' function_call item of
    status "incomplete", Messages' `cut_tool_use` (and no tool_use block in the whole message)."""
    import anthropic

    from edgeinfer import Engine

    _, url, model, client, export = served
    engine = Engine.load(export, provider="cpu")
    asked = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0)
    budget, cut = next(
        (n, r.cut_tool_call)
        for n in range(40, 90, 4)
        if not (r := engine.chat(ASK, max_new_tokens=n, **asked)).tool_calls and r.cut_tool_call and len(r.cut_tool_call.arguments) > 2
    )
    assert cut.name == "get_weather" and cut.arguments and engine.chat(ASK, max_new_tokens=budget, **asked).finish_reason == "length"
    chat = dict(model=model, messages=ASK, max_tokens=budget, **asked)
    choice = client.chat.completions.create(**chat).choices[0]
    assert (choice.finish_reason, choice.message.tool_calls) == ("length", None)
    said = choice.model_extra["cut_tool_call"]
    assert (said["index"], said["function"]["name"], said["function"]["arguments"]) == (0, "get_weather", cut.arguments)
    chunks = [c for c in client.chat.completions.create(**chat, stream=True) if c.choices]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices[0].model_extra["cut_tool_call"]["function"]["arguments"] == cut.arguments
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    responses = dict(model=model, input=ASK[0]["content"], tools=flat, tool_choice={"type": "function", "name": "get_weather"})
    response = client.responses.create(**responses, max_output_tokens=budget, temperature=0)
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert [(i.type, i.status, i.arguments) for i in response.output if i.type == "function_call"] == [
        ("function_call", "incomplete", cut.arguments)
    ]
    events = list(client.responses.create(**responses, max_output_tokens=budget, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete" and not any(e.type == "response.function_call_arguments.done" for e in events)
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(i.status, i.arguments) for i in done] == [("incomplete", cut.arguments)]
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    messages = dict(model=model, messages=ASK, tools=tools, tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=budget)
    message = claude.messages.create(**messages, extra_body={"temperature": 0})
    assert message.stop_reason == "max_tokens" and not [b for b in message.content if b.type == "tool_use"]
    assert message.model_extra["cut_tool_use"] == {
        "id": "toolu_" + message.model_extra["cut_tool_use"]["id"][6:],
        "name": "get_weather",
        "partial_json": cut.arguments,
    }
    with claude.messages.stream(**messages, extra_body={"temperature": 0}) as stream:
        ending = [e for e in stream if e.type == "message_delta"][-1]
    assert ending.delta.stop_reason == "max_tokens" and ending.delta.model_extra["cut_tool_use"]["partial_json"] == cut.arguments


@pytest.mark.parametrize(
    "asked, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools"),
        ({"messages": [{"role": "tool", "content": "21"}]}, "messages[0]"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(served, asked, param):
    _, url, model, _, _ = served
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": ASK, "max_tokens": 4, **asked})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()
    if param == "response_format":  # the SDK's chat turn refuses it, in the same words for the engine (test_tools.py)
        assert response.json()["error"]["message"].startswith("response_format and choice cannot constrain a turn that must call")


def test_a_thought_bounded_by_its_budget_is_the_same_in_all_three_apis(tmp_path_factory):
    """A template that opens the thought in its prompt; thinking_token_budget (chat completions and
    Responses) and thinking.budget_tokens (Messages) end it after 6 tokens, as the SDK's
    reasoning_budget does; the thought is reasoning_content, a reasoning item, a thinking block."""
    import anthropic
    from test_chat_stream import OPENED

    from edgeinfer import Engine

    export = tool_export(tmp_path_factory.mktemp("serve-budget"), OPENED)
    expected = Engine.load(export, provider="cpu").chat(ASK, reasoning_budget=6, max_new_tokens=20)
    assert expected.reasoning and expected.text
    process, url = start(export, "--provider", "cpu")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        asked = dict(model=export.name, messages=ASK, max_tokens=20, temperature=0, extra_body={"thinking_token_budget": 6})
        reply = client.chat.completions.create(**asked)
        message = reply.choices[0].message
        assert (message.model_extra["reasoning_content"], message.content) == (expected.reasoning, expected.text)
        assert reply.usage.completion_tokens_details.reasoning_tokens == expected.reasoning_tokens > 6
        deltas = [c.choices[0].delta for c in client.chat.completions.create(**asked, stream=True) if c.choices]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == expected.reasoning
        question = dict(model=export.name, input=ASK[0]["content"], max_output_tokens=20, temperature=0)
        response = client.responses.create(**question, extra_body={"thinking_token_budget": 6})
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == expected.reasoning and response.output_text == expected.text
        events = list(client.responses.create(**question, extra_body={"thinking_token_budget": 6}, stream=True))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == expected.reasoning
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected.text
        assert events[-1].response.output[0].content[0].text == expected.reasoning
        claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        asked = dict(model=export.name, max_tokens=20, messages=ASK, thinking={"type": "enabled", "budget_tokens": 6})
        reply = claude.messages.create(**asked, extra_body={"temperature": 0})
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in reply.content] == [
            ("thinking", expected.reasoning),
            ("text", expected.text),
        ]
        with claude.messages.stream(**asked, extra_body={"temperature": 0}) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == expected.reasoning
        refused = httpx.post(f"{url}/v1/chat/completions", json={**asked, "messages": ASK, "thinking_token_budget": -1})
        assert refused.status_code == 400
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def test_a_reasoning_models_thought_is_reasoning_content_whole_and_streamed(tmp_path_factory):
    from test_reasoning import OUTPUT, THINKING

    export = tool_export(tmp_path_factory.mktemp("serve-thinking"), THINKING)
    process, url = start(export, "--provider", "cpu")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        asked = dict(model=export.name, messages=ASK, max_tokens=60, extra_body={"choice": [OUTPUT]})
        message = client.chat.completions.create(**asked).choices[0].message
        assert (message.model_extra["reasoning_content"], message.content) == ("The user asks about Paris.\n", "It is sunny.")
        deltas = [c.choices[0].delta for c in client.chat.completions.create(**asked, stream=True) if c.choices]
        thought = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
        assert (thought, "".join(d.content or "" for d in deltas)) == ("The user asks about Paris.\n", "It is sunny.")
        off = dict(asked, extra_body={"choice": ["It is sunny."], "chat_template_kwargs": {"enable_thinking": False}})
        plain = client.chat.completions.create(**off).choices[0].message
        assert plain.content == "It is sunny." and "reasoning_content" not in (plain.model_extra or {})
        effort = dict(asked, extra_body={"choice": ["It is sunny."]}, reasoning_effort="none")
        plain = client.chat.completions.create(**effort)
        assert (
            plain.choices[0].message.content == "It is sunny."
            and plain.usage.prompt_tokens == client.chat.completions.create(**off).usage.prompt_tokens
        )  # the same prompt as enable_thinking false: the thought closed for the model
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
