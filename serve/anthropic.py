"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a translation
onto the same conversation, settings and tool machinery as the OpenAI routes: the request becomes
the SDK's messages and tools, the result becomes Anthropic's content blocks and events. Nothing
here knows of HTTP or of the scheduler."""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from edgeinfer.sdk.chat_stream import ChatDelta
from edgeinfer.sdk.sequence import GenerationResult
from edgeinfer.sdk.tool_parser import CallOpened, Said
from edgeinfer.sdk.tools import ToolRequest, tool_request
from edgeinfer.sdk.vision import content_of

from .api import Api, Event, Served
from .checks import SEED_MAX, ImagePart, Real, RequestError, check_answers, check_json, refuse_images
from .images import ImagePartModel, image_data, image_part

STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens", "tool_calls": "tool_use"}
API_NAMES = {"max_new_tokens": "max_tokens", "reasoning_budget": "thinking.budget_tokens"}  # SDK settings named otherwise here
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
ERROR_TYPES |= {408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Strict):
    type: Literal["text"]
    text: StrictStr
    cache_control: dict[str, Any] | None = None  # accepted; edgeinfer's prefix cache needs no marks


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class Base64Source(_Strict):
    type: Literal["base64"]
    media_type: StrictStr
    data: StrictStr


class URLSource(_Strict):
    type: Literal["url"]
    url: StrictStr


class ImageBlock(ImagePartModel):
    """An image: base64 data, or a URL fetched only where the server runs with --allow-image-urls."""

    type: Literal["image"]
    source: Base64Source | URLSource
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _read(self):
        source = self.source
        self._part = image_part(source.url) if isinstance(source, URLSource) else image_data(source.media_type, source.data)
        return self


class ThinkingBlock(_Strict):
    """A thought sent back in an assistant message: given to the template as the message's
    reasoning_content (templates decide whether to show earlier thoughts; most leave them out)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: StrictStr | None = None
    signature: StrictStr | None = None
    data: StrictStr | None = None


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = Field(default=None, ge=0)  # the thought ends after this many tokens


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[TextBlock | ImagePart] = ""
    is_error: StrictBool | None = None
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _text_only(self):
        refuse_images(self.content)
        return self

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: StrictStr | list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | ImageBlock]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self):
        if isinstance(self.content, list):
            wrong = ("tool_result", "image") if self.role == "assistant" else ("tool_use", "thinking", "redacted_thinking")
            found = next((block.type for block in self.content if block.type in wrong), None)
            if found is not None:
                raise ValueError(f"a {found} block cannot be in a {self.role} message")
        return self

    def as_dicts(self) -> list[dict]:
        """The SDK's messages: tool results become tool messages, tool uses an assistant's tool_calls."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = content_of(
            [
                b.sdk_part() if b.type == "image" else {"type": "text", "text": b.text}
                for b in self.content
                if b.type in ("text", "image")
            ]
        )
        results = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()} for b in self.content if b.type == "tool_result"
        ]
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
            for b in self.content
            if b.type == "tool_use"
        ]
        if self.role == "assistant":
            thought = "".join(b.thinking or "" for b in self.content if b.type == "thinking")
            message = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
            return [{**message, "reasoning_content": thought} if thought else message]
        return [*results, *([{"role": "user", "content": text}] if text or not results else [])]


class Tool(_Strict):
    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None

    def as_openai(self) -> dict:
        function = {"name": self.name, "parameters": self.input_schema}
        return {"type": "function", "function": function | ({"description": self.description} if self.description else {})}


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class MessagesRequest(_Strict):
    model: StrictStr
    max_tokens: StrictInt = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: StrictStr | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: Real | None = Field(default=None, ge=0, le=1)
    top_p: Real | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=0)
    seed: StrictInt | None = Field(default=None, ge=0, le=SEED_MAX)  # edgeinfer's: the same tokens each time, as OpenAI's seed
    stream: StrictBool = False
    # routing, billing and caching hints that mean nothing to one local server: accepted and ignored
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None
    cache_control: dict[str, Any] | None = None
    inference_geo: StrictStr | None = None
    speed: StrictStr | None = None
    # a reasoning model's thought: "disabled" turns it off where the template can, budget_tokens bounds it
    thinking: ThinkingConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, body):
        check_json(body)
        return body

    def conversation(self) -> list[dict]:
        system = self.system if isinstance(self.system, str) or self.system is None else "".join(b.text for b in self.system)
        messages = [*([{"role": "system", "content": system}] if system else []), *(d for m in self.messages for d in m.as_dicts())]
        return check_answers(messages, "messages")

    def settings(self) -> dict:
        chosen = {
            "max_new_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop_sequences,
            "reasoning_budget": self.reasoning_budget,
        }
        return {name: value for name, value in chosen.items() if value is not None}

    @property
    def reasoning_budget(self) -> int | None:
        return self.thinking.budget_tokens if self.thinking is not None else None

    def template_kwargs(self) -> dict:
        """The template's switch (enable_thinking) as `thinking` sets it."""
        return (
            {} if self.thinking is None or self.thinking.type == "adaptive" else {"enable_thinking": self.thinking.type == "enabled"}
        )

    def choice_settings(self) -> list[dict]:
        return [self.settings()]

    @property
    def asked_tokens(self) -> int:
        return self.max_tokens

    def tool_request(self) -> ToolRequest | None:
        """Anthropic's tools and tool_choice as the SDK's (auto, any: required, tool: named, none)."""
        if not self.tools:
            if self.tool_choice is not None and self.tool_choice.type != "none":
                raise RequestError("tool_choice needs tools: send the tools it chooses from", "tool_choice")
            return None
        choice = self.tool_choice or ToolChoice(type="auto")
        if choice.type == "tool" and not choice.name:
            raise RequestError('tool_choice of type "tool" needs the tool\'s name', "tool_choice")
        chosen = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
            "type": "function",
            "function": {"name": choice.name},
        }
        several = choice.disable_parallel_tool_use is False  # several calls only when asked
        return tool_request([t.as_openai() for t in self.tools], chosen, several)


class MessagesReply:
    """One Messages response: whole, or as the stream's events, (event, data) pairs."""

    def __init__(self, model: str, stops: list[str], decode, prompt_tokens: int = 0):
        """`decode` turns token ids into text (to tell which stop sequence ended a turn)."""
        self.id, self.model, self.stops, self.decode = f"msg_{uuid.uuid4().hex[:24]}", model, stops, decode
        self.prompt_tokens = prompt_tokens  # what the stream's first event counts
        self.open, self.started = None, 0  # the kind of the block being streamed; blocks started so far

    @classmethod
    def of(cls, body: MessagesRequest, served: Served) -> MessagesReply:
        return cls(served.model, body.stop_sequences or [], served.tokenizer.decode, served.prompt_tokens)

    def whole(self, results: list[GenerationResult]) -> dict:
        result = results[0]
        return {**self._head(), "content": blocks(result), **self._ending(result), "usage": usage(result.prompt_tokens, result)}

    def opening(self) -> list[Event]:
        message = {**self._head(), "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(self.prompt_tokens)}
        return [("message_start", {"type": "message_start", "message": message})]

    def delta(self, index: int, delta: ChatDelta) -> list[Event]:
        """The events of a turn's delta: a block started where the kind of output changes (a
        thinking block, the text, a tool_use per call), then its delta."""
        out = []
        for part in delta.parts:
            kind = {"reasoning": "thinking", "text": "text"}[part.kind] if isinstance(part, Said) else "tool_use"
            if isinstance(part, CallOpened) or self.open != kind:
                out += self._start(kind, part)
            if isinstance(part, CallOpened):
                continue
            said = {"thinking": {"type": "thinking_delta", "thinking": part.text}, "text": {"type": "text_delta", "text": part.text}}
            said = said.get(kind) or {"type": "input_json_delta", "partial_json": part.text}
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self.started - 1, "delta": said}))
        return out

    def closing(self, index: int, result: GenerationResult) -> list[Event]:
        """The last events: the open block stopped (an empty text block where the turn said
        nothing), then the stop reason and usage."""
        out = self._stop()
        if not result.text and not result.tool_calls and result.cut_tool_call is None:
            out += self._start("text") + self._stop()
        ending = {"type": "message_delta", "delta": self._ending(result), "usage": {"output_tokens": len(result.token_ids)}}
        return [*out, ("message_delta", ending), ("message_stop", {"type": "message_stop"})]

    def ending(self, results: list[GenerationResult]) -> list[Event]:
        return []

    def error_event(self, status: int, body: dict) -> Event:
        return "error", error_shape(status, body)

    def _start(self, kind: str, part: CallOpened | None = None) -> list[Event]:
        out = self._stop()
        if kind == "tool_use":
            block = {"type": "tool_use", "id": _tool_use_id(part.id), "name": part.name, "input": {}}
        else:
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
        self.open, self.started = kind, self.started + 1
        return [*out, ("content_block_start", {"type": "content_block_start", "index": self.started - 1, "content_block": block})]

    def _stop(self) -> list[Event]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.started - 1})]

    def _head(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def _ending(self, result: GenerationResult) -> dict:
        reason = STOP_REASONS[result.finish_reason]
        said = self.decode(result.token_ids)[len(result.text) :] if reason == "stop_sequence" else ""
        ending = {"stop_reason": reason, "stop_sequence": next((s for s in self.stops if said.startswith(s)), None) if said else None}
        cut = result.cut_tool_call  # the tool use the reply ended inside: no tool_use block of the whole message
        if cut is not None:
            ending["cut_tool_use"] = {"id": _tool_use_id(cut.id), "name": cut.name, "partial_json": cut.arguments}
        return ending


def usage(prompt_tokens: int, result: GenerationResult | None = None) -> dict:
    cached = result.cached_tokens if result is not None else 0
    return {
        "input_tokens": prompt_tokens - cached,
        "output_tokens": len(result.token_ids) if result is not None else 0,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def blocks(result: GenerationResult) -> list[dict]:
    """A turn's content blocks: its thought, its text (where there is some, or where it made no
    call), then a tool_use per call."""
    out = [] if result.reasoning is None else [{"type": "thinking", "thinking": result.reasoning, "signature": ""}]
    if result.text or not result.tool_calls:
        out.append({"type": "text", "text": result.text})
    for call in result.tool_calls or []:
        out.append({"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name, "input": _input(call.arguments)})
    return out


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict:
    """A whole call's arguments as a tool_use block's input."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def error_shape(status: int, body: dict) -> dict:
    """Anthropic's error of one in OpenAI's shape: a client's error (4xx) is never typed as the
    server's (api_error)."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}


class CountTokensRequest(MessagesRequest):
    """`/v1/messages/count_tokens`: a Messages request without max_tokens (and never streamed)."""

    max_tokens: StrictInt | None = Field(default=None, ge=1)

    @property
    def asked_tokens(self) -> int | None:
        return None

    def settings(self) -> dict:
        return {}


MESSAGES = Api(
    "/v1/messages",
    MessagesRequest,
    "messages",
    API_NAMES,
    error_shape=error_shape,
    conversation=lambda body, store: body.conversation(),
    reply=MessagesReply.of,
    bodies=(CountTokensRequest,),
)
