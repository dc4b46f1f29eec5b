"""OpenAI's Responses API (`POST /v1/responses`) as a translation onto the same conversation,
settings and tool machinery as chat completions: input items become the SDK's messages, the result
becomes output items and the stream's typed events. `previous_response_id` continues a stored
response (an in-memory store of recent ones, bounded by count, bytes and time; `store: false`
keeps nothing). Nothing here knows of HTTP or of the scheduler."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from edgeinfer.sdk.chat_stream import ChatDelta
from edgeinfer.sdk.sequence import GenerationResult
from edgeinfer.sdk.tokenizer import template_variables
from edgeinfer.sdk.tool_parser import CallOpened, Said
from edgeinfer.sdk.tools import ToolRequest, tool_request
from edgeinfer.sdk.vision import content_of

from .api import Api, Event, Served
from .checks import Real, RequestError, check_answers, check_json
from .images import ImagePartModel, image_part

API_NAMES = {
    "max_new_tokens": "max_output_tokens",
    "reasoning_budget": "thinking_token_budget",
    "messages": "input",
}  # SDK names, named otherwise here
STORED = 256  # responses kept for previous_response_id, least recently used out first
STORED_BYTES = 64 * 2**20  # ...and the bytes of their JSON
STORED_TTL_S = 3600.0  # ...each for this long after its last use


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContentPart(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: StrictStr
    annotations: list[Any] | None = None


class InputImagePart(ImagePartModel):
    """An image: `image_url` a data: URL (base64), or an http(s) URL fetched only with --allow-image-urls."""

    type: Literal["input_image"]
    image_url: StrictStr | None = None
    file_id: StrictStr | None = None
    detail: Literal["auto", "low", "high"] | None = None

    @model_validator(mode="after")
    def _read(self):
        if self.image_url is None:
            raise ValueError("an input_image needs image_url (a data: URL): this server keeps no files, so file_id is not taken")
        self._part = image_part(self.image_url)
        return self


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[ContentPart | InputImagePart]
    id: StrictStr | None = None
    status: StrictStr | None = None

    @model_validator(mode="after")
    def _images_from_the_user(self):
        if isinstance(self.content, list) and self.role != "user" and any(p.type == "input_image" for p in self.content):
            raise ValueError(f"an input_image belongs to a user message, not to a {self.role} message")
        return self

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = content_of([p.sdk_part() if p.type == "input_image" else {"type": "text", "text": p.text} for p in content])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class ReasoningItem(_Strict):
    """A thought sent back with the conversation: accepted, and left out of the next prompt (as
    chat templates leave earlier thoughts out)."""

    type: Literal["reasoning"]
    id: StrictStr | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: StrictStr | None = None
    status: StrictStr | None = None


class FunctionOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


Item = MessageItem | FunctionCallItem | FunctionOutputItem | ReasoningItem


class FunctionTool(_Strict):
    type: Literal["function"]
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: StrictBool | None = None

    def as_chat(self) -> dict:
        function = {"name": self.name, "parameters": self.parameters}
        return {"type": "function", "function": function | ({"description": self.description} if self.description else {})}


class TextFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None
    description: StrictStr | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None


class ReasoningOptions(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None  # "none" turns thinking off
    summary: StrictStr | None = None  # accepted; the thought is given whole


class ResponsesRequest(_Strict):
    model: StrictStr
    input: StrictStr | list[Item] = Field(min_length=1)
    instructions: StrictStr | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextOptions | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Real | None = Field(default=None, ge=0)
    top_p: Real | None = Field(default=None, gt=0, le=1)
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None  # accepted and ignored, as the API allows
    reasoning: ReasoningOptions | None = None
    # edgeinfer's, as on chat completions: the template's own variables, and the thought's budget
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_token_budget: StrictInt | None = Field(default=None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, body):
        check_json(body)
        return body

    def items(self) -> list[dict]:
        """This request's input as item dicts, as a stored response keeps them."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(by_alias=True, exclude_none=True) for item in self.input]

    def template_kwargs(self) -> dict:
        off = {"enable_thinking": False} if self.reasoning is not None and self.reasoning.effort == "none" else {}
        return {**off, **template_variables(self.chat_template_kwargs)}

    def settings(self) -> dict:
        chosen = {
            "max_new_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "reasoning_budget": self.thinking_token_budget,
        }
        format = self.text.format if self.text is not None else None
        if format is not None and format.type == "json_object":
            chosen["response_format"] = {"type": "json_object"}
        elif format is not None and format.type == "json_schema":
            if format.schema_ is None:
                raise RequestError("text.format of type json_schema needs its schema", "text")
            chosen["response_format"] = {"type": "json_schema", "json_schema": {"schema": format.schema_}}
        return {name: value for name, value in chosen.items() if value is not None}

    def choice_settings(self) -> list[dict]:
        return [self.settings()]

    @property
    def asked_tokens(self) -> int | None:
        return self.max_output_tokens

    def tool_request(self) -> ToolRequest | None:
        if not self.tools:
            if self.tool_choice not in (None, "none", "auto"):
                raise RequestError("tool_choice needs tools: send the tools it chooses from", "tool_choice")
            return None
        choice = self.tool_choice
        if isinstance(choice, dict):  # the Responses API names a function flat: {"type": "function", "name": ...}
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or set(choice) != {"type", "name"}:
                raise RequestError(
                    f'tool_choice {choice!r} is not one this API takes: send "auto", "none", "required" or '
                    '{"type": "function", "name": NAME}',
                    "tool_choice",
                )
            choice = {"type": "function", "function": {"name": choice["name"]}}
        return tool_request([t.as_chat() for t in self.tools], choice, self.parallel_tool_calls is True)  # several only when asked


def conversation(instructions: str | None, items: list[dict]) -> list[dict]:
    """The SDK's messages of input items: function calls become an assistant's tool_calls (those in
    a row, one message), their outputs tool messages."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if item["type"] == "message":
            messages.append(MessageItem(**item).as_dict())
        elif item["type"] == "reasoning":
            continue
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return check_answers(messages, "input")


class InputTokensRequest(ResponsesRequest):
    """POST /v1/responses/input_tokens: the input a response would be made from, to count its
    prompt's tokens (tools and the stored conversation included); `model` may be left out where
    one model is served."""

    model: StrictStr | None = None


@dataclass(frozen=True)
class StoreLimits:
    """How much the Responses store keeps: at most `count` responses and `bytes` of them (each kept
    as its compact JSON), each for `ttl` seconds after its last use (None: no TTL)."""

    count: int = STORED
    bytes: int = STORED_BYTES
    ttl: float | None = STORED_TTL_S


@dataclass
class _Kept:
    parent: str | None  # the response this one continued (previous_response_id)
    turn: bytes  # this turn's input and output items, as compact JSON: what its prompt needs
    response: bytes  # the response object as returned, for GET
    used: float  # time.monotonic() of its last use


class Store:
    """Responses made with store true, for previous_response_id and GET /v1/responses/{id}. Each
    keeps its own turn only (its input items and its output), with a link to the response it
    continued, so a chain of N turns holds N turns, not N histories; reasoning items, which never
    reach a prompt, are not kept in a turn. Bounded by count and bytes (least recently used out
    first; a continued chain is used as a whole) and by a TTL."""

    def __init__(self, limits: StoreLimits = StoreLimits(), clock=time.monotonic):
        self.limits, self._clock = limits, clock
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes, self.evicted, self.refused = 0, 0, 0

    def history(self, response_id: str | None) -> list[dict]:
        """The items of a stored response and every turn before it (its instructions are not
        carried over, as OpenAI's are not); RequestError (404) where it, or a turn it continues,
        is gone."""
        chain = []  # (id, kept), the newest first
        with self._lock:
            self._expire()
            while response_id is not None:
                kept = self._kept.get(response_id)
                if kept is None:
                    raise self._gone(response_id, first=not chain)
                chain.append((response_id, kept))
                response_id = kept.parent
            for response_id, kept in reversed(chain):  # used as a whole, the newest turn the most recently
                kept.used = self._clock()
                self._kept.move_to_end(response_id)
        return [item for _, kept in reversed(chain) for item in json.loads(kept.turn)]

    def keep(self, response_id: str, parent: str | None, items: list[dict], response: dict) -> None:
        """Keep a response's turn (`items`: its input and output items) and the response itself."""
        turn = _compact([item for item in items if item.get("type") != "reasoning"])
        kept = _Kept(parent, turn, _compact(response), self._clock())
        size = len(kept.turn) + len(kept.response)
        with self._lock:
            if size > self.limits.bytes:
                self.refused += 1
                return
            self._kept[response_id] = kept
            self.bytes += size
            self._expire()
            while len(self._kept) > self.limits.count or self.bytes > self.limits.bytes:
                self._drop(next(iter(self._kept)))
                self.evicted += 1

    def get(self, response_id: str) -> dict:
        """The stored response object; RequestError (404) where it is not stored."""
        with self._lock:
            self._expire()
            kept = self._kept.get(response_id)
            if kept is None:
                raise self._gone(response_id, first=True, param=None)
            return json.loads(kept.response)

    def delete(self, response_id: str) -> None:
        """Forget a response (those that continue it can no longer be continued); 404 where it is not stored."""
        with self._lock:
            if response_id not in self._kept:
                raise self._gone(response_id, first=True, param=None)
            self._drop(response_id)

    def stats(self) -> dict[str, float]:
        with self._lock:
            self._expire()
            return {
                "responses_stored": len(self._kept),
                "responses_stored_bytes": self.bytes,
                "responses_store_evicted": self.evicted,
                "responses_store_refused": self.refused,
            }

    def _drop(self, response_id: str) -> None:
        kept = self._kept.pop(response_id)
        self.bytes -= len(kept.turn) + len(kept.response)

    def _expire(self) -> None:
        """Under the lock: drop the responses unused for the TTL (the least recently used come first)."""
        if self.limits.ttl is None:
            return
        deadline = self._clock() - self.limits.ttl
        while self._kept and next(iter(self._kept.values())).used < deadline:
            self._drop(next(iter(self._kept)))
            self.evicted += 1

    def _gone(self, response_id: str, first: bool, param: str | None = "previous_response_id") -> RequestError:
        kept = f"this server keeps up to {self.limits.count} responses made with store true ({self.limits.bytes // 2**20} MiB"
        kept += f", each {self.limits.ttl:g} s after its last use)" if self.limits.ttl is not None else ")"
        what = f"no stored response {response_id!r}" if first else f"the stored conversation lost its earlier response {response_id!r}"
        way = ": send the whole conversation as input instead" if param else ""
        return RequestError(f"{what}: {kept}, in memory{way}", param, status=404, code="not_found")


def _compact(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


class ResponsesReply:
    """One response object: whole, or as the stream's typed events, an output item at a time
    (the thought, the message, each function call) as the turn is generated."""

    def __init__(self, model: str, request: ResponsesRequest, store: Store | None = None):
        """`store` keeps the response, where the request asks (`store` true)."""
        self.id, self.model, self.request, self.store = f"resp_{uuid.uuid4().hex[:24]}", model, request, store
        self.created, self.sequence = int(time.time()), 0
        self.message_id, self.reasoning_id = f"msg_{uuid.uuid4().hex[:24]}", f"rs_{uuid.uuid4().hex[:24]}"
        self.open: dict | None = None  # the item being streamed: its kind, output index, id and text so far
        self.opened = 0  # items streamed so far

    @classmethod
    def of(cls, body: ResponsesRequest, served: Served) -> ResponsesReply:
        return cls(served.model, body, served.store)

    def output(self, result: GenerationResult) -> list[dict]:
        items = [] if result.reasoning is None else [self._reasoning_item(result.reasoning)]
        if result.text or not result.tool_calls:
            items.append(self._message_item(result.text))
        calls = [_call_item(call.id, call.name, call.arguments) for call in result.tool_calls or []]
        cut = result.cut_tool_call  # the call the reply ended inside: an item of status "incomplete"
        return items + calls + ([] if cut is None else [_call_item(cut.id, cut.name, cut.arguments, "incomplete")])

    def _reasoning_item(self, text: str, status: str = "completed") -> dict:
        content = [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content, "status": status}

    def _message_item(self, text: str | None, status: str = "completed") -> dict:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def whole(self, results: list[GenerationResult]) -> dict:
        """The response object, kept where the request asks."""
        return self._kept(self.response(results[0]))

    def _kept(self, response: dict) -> dict:
        if self.request.store and self.store is not None:
            items = [*self.request.items(), *output_items(response)]
            self.store.keep(self.id, self.request.previous_response_id, items, response)
        return response

    def response(self, result: GenerationResult | None, status: str = "completed") -> dict:
        """The response object; `result` None: one in progress (the stream's first events)."""
        cut = result is not None and result.finish_reason == "length"
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if cut else status,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "error": None,
            "model": self.model,
            "instructions": self.request.instructions,
            "output": [] if result is None else self.output(result),
            "parallel_tool_calls": self.request.parallel_tool_calls is True,
            "tool_choice": self.request.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in self.request.tools or []],
            "temperature": self.request.temperature,
            "top_p": self.request.top_p,
            "max_output_tokens": self.request.max_output_tokens,
            "previous_response_id": self.request.previous_response_id,
            "store": self.request.store,
            "metadata": self.request.metadata or {},
            "text": {"format": {"type": "text"}}
            if self.request.text is None
            else self.request.text.model_dump(by_alias=True, exclude_none=True),
            "usage": None if result is None else _usage(result),
        }
        return body

    def event(self, kind: str, **fields) -> Event:
        self.sequence += 1
        return kind, {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def opening(self) -> list[Event]:
        return [
            self.event("response.created", response=self.response(None, "in_progress")),
            self.event("response.in_progress", response=self.response(None, "in_progress")),
        ]

    def delta(self, index: int, delta: ChatDelta) -> list[Event]:
        """The events of a turn's delta: an item opened where the kind of output changes, then its delta."""
        out = []
        for part in delta.parts:
            kind = {"reasoning": "reasoning", "text": "message"}[part.kind] if isinstance(part, Said) else "function_call"
            if isinstance(part, CallOpened) or self.open is None or self.open["kind"] != kind:
                out += self._open(kind, part)
            if isinstance(part, CallOpened):
                continue
            said = part.text
            self.open["text"] += said
            where = {"item_id": self.open["id"], "output_index": self.open["index"]}
            if kind == "reasoning":
                out.append(self.event("response.reasoning_text.delta", **where, content_index=0, delta=said))
            elif kind == "message":
                out.append(self.event("response.output_text.delta", **where, content_index=0, delta=said, logprobs=[]))
            else:
                out.append(self.event("response.function_call_arguments.delta", **where, delta=said))
        return out

    def closing(self, index: int, result: GenerationResult) -> list[Event]:
        """The last events: the open item closed (an empty message where the turn said nothing), then
        response.completed (or .incomplete) with the whole response (kept where the request asks)."""
        out = self._close(cut=result.cut_tool_call is not None)
        if not result.text and not result.tool_calls and result.cut_tool_call is None:
            out += self._open("message") + self._close()
        whole = self._kept(self.response(result))
        return [*out, self.event("response.completed" if whole["status"] == "completed" else "response.incomplete", response=whole)]

    def ending(self, results: list[GenerationResult]) -> list[Event]:
        return []

    def error_event(self, status: int, body: dict) -> Event:
        error = body["error"]
        return self.event("error", message=error["message"], code=error["code"], param=error["param"])

    def _open(self, kind: str, part: CallOpened | None = None) -> list[Event]:
        out = self._close()
        index, self.opened = self.opened, self.opened + 1
        if kind == "reasoning":
            self.open, item = {"id": self.reasoning_id}, self._reasoning_item("", "in_progress")
            item["content"] = []
        elif kind == "message":
            self.open, item = {"id": self.message_id}, self._message_item(None, "in_progress")
        else:
            call_id, name = part.id, part.name
            item = {**_call_item(call_id, name, ""), "status": "in_progress"}
            self.open = {"id": item["id"], "call_id": call_id, "name": name}
        self.open |= {"kind": kind, "index": index, "text": ""}
        out.append(self.event("response.output_item.added", output_index=index, item=item))
        if kind != "function_call":
            part_kind = "reasoning_text" if kind == "reasoning" else "output_text"
            empty = {"type": part_kind, "text": ""} | ({"annotations": []} if kind == "message" else {})
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=empty))
        return out

    def _close(self, cut: bool = False) -> list[Event]:
        """The open item's closing events; `cut`: the reply ended inside it, a call left incomplete."""
        if self.open is None:
            return []
        opened, self.open = self.open, None
        where, text = {"item_id": opened["id"], "output_index": opened["index"]}, opened["text"]
        if opened["kind"] == "function_call" and cut:
            item, done = _call_item(opened["call_id"], opened["name"], text, "incomplete"), []
        elif opened["kind"] == "function_call":
            item = _call_item(opened["call_id"], opened["name"], text)
            done = [self.event("response.function_call_arguments.done", **where, arguments=text)]
        else:
            item = self._reasoning_item(text) if opened["kind"] == "reasoning" else self._message_item(text)
            kind = "reasoning_text" if opened["kind"] == "reasoning" else "output_text"
            done = [
                self.event(
                    f"response.{kind}.done", **where, content_index=0, text=text, **({"logprobs": []} if kind == "output_text" else {})
                ),
                self.event("response.content_part.done", **where, content_index=0, part=item["content"][0]),
            ]
        return [*done, self.event("response.output_item.done", output_index=opened["index"], item=item)]


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": "fc_" + call_id.removeprefix("call_"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _usage(result: GenerationResult) -> dict:
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": result.cached_tokens,
            **({"image_tokens": result.image_tokens} if result.image_tokens else {}),
        },
        "output_tokens": len(result.token_ids),
        "output_tokens_details": {"reasoning_tokens": result.reasoning_tokens},
        "total_tokens": result.prompt_tokens + len(result.token_ids),
    }


def output_items(reply: dict) -> list[dict]:
    """A response's output as input items for the next turn (previous_response_id)."""
    items = []
    for item in reply["output"]:
        if item["type"] == "message":
            items.append({"type": "message", "role": "assistant", "content": item["content"][0]["text"]})
        elif item["type"] == "function_call" and item["status"] == "completed":  # a cut call is no call to answer
            items.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
    return items


RESPONSES = Api(
    "/v1/responses",
    ResponsesRequest,
    "input",
    API_NAMES,
    conversation=lambda body, store: conversation(body.instructions, [*store.history(body.previous_response_id), *body.items()]),
    reply=ResponsesReply.of,
    bodies=(InputTokensRequest,),
)
