"""OpenAI's Responses API through `edgeinfer serve`, driven by the real openai client: the same text
as the SDK for the same conversation, whole and streamed (the client's stream helper checks the
events), function calls valid for their schema, previous_response_id from the store (and a 404
once it is gone), instructions, and text.format."""

import json
import signal

import jsonschema
import openai
import pytest
from test_serve import start
from test_serve_tools import tool_export
from test_tools import HERMES, SCHEMAS, TOOLS

from edgeinfer import Engine

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    export = tool_export(tmp_path_factory.mktemp("serve-responses"), HERMES)
    process, url = start(export, "--provider", "cpu", "--max-batch", "2")
    yield export, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def engine(served):
    return Engine.load(served[0], provider="cpu")


def test_a_reply_is_the_sdks_whole_and_streamed(served, engine):
    export, client = served
    expected = engine.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}], max_new_tokens=12)
    response = client.responses.create(model=export.name, input=QUESTION, instructions="Be brief.", max_output_tokens=12)
    assert response.object == "response" and response.output_text == expected.text
    assert response.status == ("incomplete" if expected.finish_reason == "length" else "completed")
    assert response.usage.input_tokens == expected.prompt_tokens and response.usage.output_tokens == len(expected.token_ids)
    # the raw events: a response cut by max_output_tokens ends with response.incomplete, as OpenAI's
    # does, which the client's stream helper (it waits for response.completed) does not take
    events = list(
        client.responses.create(model=export.name, input=QUESTION, instructions="Be brief.", max_output_tokens=12, stream=True)
    )
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds.count("response.output_text.delta") >= 2
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected.text
    assert kinds[-1] == ("response.incomplete" if expected.finish_reason == "length" else "response.completed")
    assert events[-1].response.output_text == expected.text and [e.sequence_number for e in events] == list(range(len(events)))


def test_function_calls_validate_and_continue_from_the_store(served, engine):
    export, client = served
    asked = dict(
        model=export.name, tools=FLAT_TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, max_output_tokens=200
    )
    first = client.responses.create(input=QUESTION, **asked)
    (call,) = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    with client.responses.stream(input=QUESTION, **asked) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds.count("response.function_call_arguments.delta") >= 3  # the arguments in pieces, as generated
    (again,) = [item for item in streamed.output if item.type == "function_call"]
    jsonschema.validate(json.loads(again.arguments), SCHEMAS[again.name])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}
    follow = client.responses.create(
        model=export.name, previous_response_id=first.id, input=[result], tools=FLAT_TOOLS, tool_choice="none", max_output_tokens=4
    )
    conversation = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 degrees"},
    ]
    assert follow.usage.input_tokens == len(engine.tokenizer.chat_ids(conversation))  # tool_choice none: no tools in the prompt
    assert follow.previous_response_id == first.id


def test_a_response_that_is_gone_or_never_stored_is_a_404(served):
    export, client = served
    unstored = client.responses.create(model=export.name, input=QUESTION, max_output_tokens=2, store=False)
    for gone in ("resp_nothing", unstored.id):
        with pytest.raises(openai.NotFoundError) as raised:
            client.responses.create(model=export.name, input="And?", previous_response_id=gone, max_output_tokens=2)
        assert raised.value.body["param"] == "previous_response_id" and "send the whole conversation" in raised.value.body["message"]


def test_text_format_json_schema_validates(served):
    export, client = served
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["city", "n"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    for seed in range(3):
        response = client.responses.create(model=export.name, input=QUESTION, text=text, temperature=1.0, max_output_tokens=60)
        jsonschema.validate(json.loads(response.output_text), schema)
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=export.name, input=QUESTION, tools=FLAT_TOOLS, tool_choice={"type": "function", "name": "nope"})
    assert raised.value.body["param"] == "tool_choice"
