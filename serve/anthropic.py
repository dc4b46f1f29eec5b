"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a translation
onto the same conversation, settings and tool machinery as the OpenAI routes: the request becomes
the SDK's messages and tools, the result becomes Anthropic's content blocks and events. Nothing
here knows of HTTP or of the scheduler."""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from edgeinfer.sdk.sequence import GenerationResult
from edgeinfer.sdk.tools import ToolRequest, tool_request

from .protocol import Real, RequestError, check_json

STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens", "tool_calls": "tool_use"}
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


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[TextBlock] = ""
    is_error: StrictBool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: StrictStr | list[TextBlock | ToolUseBlock | ToolResultBlock]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self):
        if isinstance(self.content, list):
            wrong = "tool_result" if self.role == "assistant" else "tool_use"
            if any(block.type == wrong for block in self.content):
                raise ValueError(f"a {wrong} block cannot be in a {self.role} message")
        return self

    def as_dicts(self) -> list[dict]:
        """The SDK's messages: tool results become tool messages, tool uses an assistant's tool_calls."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        text = "".join(b.text for b in self.content if b.type == "text")
        results = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()} for b in self.content if b.type == "tool_result"
        ]
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
            for b in self.content
            if b.type == "tool_use"
        ]
        if self.role == "assistant":
            return (
                [{"role": "assistant", "content": text or None, "tool_calls": calls}]
                if calls
                else [{"role": "assistant", "content": text}]
            )
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
    stream: StrictBool = False
    # routing, billing and caching hints that mean nothing to one local server: accepted and ignored
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None
    cache_control: dict[str, Any] | None = None
    inference_geo: StrictStr | None = None
    speed: StrictStr | None = None
    thinking: dict[str, Any] | None = None  # only {"type": "disabled"}: reasoning is not served yet

    @model_validator(mode="after")
    def _no_thinking(self):
        if self.thinking is not None and self.thinking.get("type") != "disabled":
            raise ValueError('extended thinking is not served by edgeinfer yet: leave thinking out, or send {"type": "disabled"}')
        return self

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, body):
        check_json(body)
        return body

    def conversation(self) -> list[dict]:
        system = self.system if isinstance(self.system, str) or self.system is None else "".join(b.text for b in self.system)
        return [*([{"role": "system", "content": system}] if system else []), *(d for m in self.messages for d in m.as_dicts())]

    def settings(self) -> dict:
        chosen = {
            "max_new_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
        }
        return {name: value for name, value in chosen.items() if value is not None}

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
        return tool_request([t.as_openai() for t in self.tools], chosen, not choice.disable_parallel_tool_use)


class MessagesReply:
    """One Messages response: whole, or as the stream's events, (event, data) pairs."""

    def __init__(self, model: str, stops: list[str], decode):
        """`decode` turns token ids into text (to tell which stop sequence ended a turn)."""
        self.id, self.model, self.stops, self.decode = f"msg_{uuid.uuid4().hex[:24]}", model, stops, decode

    def whole(self, result: GenerationResult) -> dict:
        return {**self._head(), "content": blocks(result), **self._ending(result), "usage": usage(result.prompt_tokens, result)}

    def opening(self, prompt_tokens: int) -> list[tuple[str, dict]]:
        message = {**self._head(), "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(prompt_tokens)}
        return [("message_start", {"type": "message_start", "message": message})]

    def text_start(self) -> tuple[str, dict]:
        return "content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}

    def text_delta(self, text: str) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}

    def closing(self, result: GenerationResult, streamed: bool) -> list[tuple[str, dict]]:
        """The rest of the stream once the turn has ended: with `streamed`, the text block was sent
        as it came and is closed here; else every block is sent now (a turn with tools)."""
        out = [("content_block_stop", {"type": "content_block_stop", "index": 0})] if streamed else []
        for index, block in enumerate(blocks(result)[1:] if streamed else blocks(result), start=int(streamed)):
            opened = {"type": "text", "text": ""} if block["type"] == "text" else {**block, "input": {}}
            delta = (
                {"type": "text_delta", "text": block["text"]}
                if block["type"] == "text"
                else {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
            )
            out.append(("content_block_start", {"type": "content_block_start", "index": index, "content_block": opened}))
            out.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
            out.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        ending = {"type": "message_delta", "delta": self._ending(result), "usage": {"output_tokens": len(result.token_ids)}}
        return [*out, ("message_delta", ending), ("message_stop", {"type": "message_stop"})]

    def _head(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def _ending(self, result: GenerationResult) -> dict:
        reason = STOP_REASONS[result.finish_reason]
        said = self.decode(result.token_ids)[len(result.text) :] if reason == "stop_sequence" else ""
        return {"stop_reason": reason, "stop_sequence": next((s for s in self.stops if said.startswith(s)), None) if said else None}


def usage(prompt_tokens: int, result: GenerationResult | None = None) -> dict:
    cached = result.cached_tokens if result is not None else 0
    return {
        "input_tokens": prompt_tokens - cached,
        "output_tokens": len(result.token_ids) if result is not None else 0,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def blocks(result: GenerationResult) -> list[dict]:
    """A turn's content blocks: its text (where there is some, or where it made no call), then a tool_use per call."""
    out = [{"type": "text", "text": result.text}] if result.text or not result.tool_calls else []
    for call in result.tool_calls or []:
        out.append(
            {
                "type": "tool_use",
                "id": "toolu_" + call.id.removeprefix("call_"),
                "name": call.name,
                "input": json.loads(call.arguments),
            }
        )
    return out


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class CountTokensRequest(MessagesRequest):
    """`/v1/messages/count_tokens`: a Messages request without max_tokens (and never streamed)."""

    max_tokens: StrictInt | None = Field(default=None, ge=1)

    @property
    def asked_tokens(self) -> int | None:
        return None

    def settings(self) -> dict:
        return {}


REQUESTS = (MessagesRequest, CountTokensRequest)
