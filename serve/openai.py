"""OpenAI's Chat Completions, Completions and Embeddings APIs as plug-ins (api.py): request bodies as
pydantic models, their translation into edgeinfer's generation settings, and the responses and
stream chunks in OpenAI's shape. Nothing here knows of HTTP or of the scheduler.

Types are strict, as OpenAI's are: `max_tokens: true` or `stream: "yes"` is a 400, not 1 or True.
The numeric ranges the SDK checks are written into the OpenAPI description (JSON schema's
`minimum`, `maximum`), and the SDK's own message answers a value outside them."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from edgeinfer.sdk.chat_stream import ChatDelta
from edgeinfer.sdk.sampling import TokenLogprob
from edgeinfer.sdk.sequence import GenerationResult
from edgeinfer.sdk.tokenizer import template_variables
from edgeinfer.sdk.tool_parser import CallOpened, Part, Said
from edgeinfer.sdk.tools import ToolRequest, tool_request
from edgeinfer.sdk.vision import content_of

from .api import Api, Event, Served
from .checks import SEED_MAX, Real, RequestError, check_answers, check_json
from .images import ImagePartModel, image_part

# Fields OpenAI defines that edgeinfer does not serve yet: a 400 naming the field, never ignored.
NOT_YET = ("functions", "function_call", "suffix", "echo", "best_of")
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "tool_calls": "tool_calls"}
MAX_CHOICES = 16  # n
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one request's inputs
# The SDK's names of settings whose API field is named otherwise.
API_NAMES = {"max_new_tokens": "max_tokens", "reasoning_budget": "thinking_token_budget"}


def _ranged(low: float | None = None, high: float | None = None, **more) -> Any:
    """A field whose range the SDK checks (with its own message), written into the OpenAPI description."""
    bounds = {k: v for k, v in (("minimum", low), ("maximum", high)) if v is not None} | more

    def into_the_number(schema: dict) -> None:
        for option in schema.get("anyOf", [schema]):
            if option.get("type") in ("number", "integer"):
                option.update(bounds)

    return Field(default=None, json_schema_extra=into_the_number)


def _described(schema: dict) -> Any:
    """A field whose OpenAPI description is `schema` (the field itself is checked elsewhere, with
    the SDK's messages)."""

    def replace(field_schema: dict) -> None:
        field_schema.clear()
        field_schema.update(schema)

    return Field(default=None, json_schema_extra=replace)


NOT_SERVED = {"type": "null", "description": "not served yet: any other value is a 400 that names the field"}
RESPONSE_FORMAT = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"type": {"enum": ["text", "json_object"]}},
            "required": ["type"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "type": {"enum": ["json_schema"]},
                "json_schema": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "schema": {"type": "object"},
                        "strict": {"type": "boolean"},
                        "description": {"type": "string"},
                    },
                    "required": ["schema"],
                },
            },
            "required": ["type", "json_schema"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {"type": {"enum": ["regex"]}, "pattern": {"type": "string", "minLength": 1}},
            "required": ["type", "pattern"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {"type": {"enum": ["grammar"]}, "lark": {"type": "string", "minLength": 1}},
            "required": ["type", "lark"],
            "additionalProperties": False,
        },
        {"type": "null"},
    ]
}
LOGIT_BIAS = {
    "anyOf": [
        {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
        {"type": "null"},
    ]
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ImageURL(_Strict):
    url: StrictStr
    detail: Literal["auto", "low", "high"] | None = None  # taken; the model's processor decides the resolution


class ImageURLPart(ImagePartModel):
    """An image: a data: URL (base64), or an http(s) URL the server fetches only with --allow-image-urls."""

    type: Literal["image_url"]
    image_url: ImageURL

    @model_validator(mode="after")
    def _read(self):
        self._part = image_part(self.image_url.url)
        return self


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr


class ToolCall(_Strict):
    id: StrictStr
    type: Literal["function"]
    function: FunctionCall


class Message(_Strict):
    """A message of the conversation. "developer" is OpenAI's current name for "system" and is
    given to the template as "system"; an assistant message may carry `tool_calls` (with
    `content` null), as agents' histories do, and a "tool" message the result of one
    (`tool_call_id`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart | ImageURLPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None  # an assistant's earlier thought, as vLLM and llama.cpp take it

    @model_validator(mode="after")
    def _has_content(self):
        if isinstance(self.content, list) and self.role != "user" and any(p.type == "image_url" for p in self.content):
            raise ValueError(f"an image_url part belongs to a user message, not to a {self.role} message")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError(f"reasoning_content belongs to assistant messages, not to a {self.role} message")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not to a {self.role} message")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs the tool_call_id it answers, and only a tool message has one")
        return self

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = content_of([p.sdk_part() if p.type == "image_url" else {"type": "text", "text": p.text} for p in content])
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:  # the template decides whether an earlier thought is shown
            message["reasoning_content"] = self.reasoning_content
        return message


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Request(_Strict):
    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Real | None = _ranged(0)
    top_p: Real | None = _ranged(None, 1, exclusiveMinimum=0)
    seed: StrictInt | None = Field(default=None, ge=0, le=SEED_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = Field(default=None, ge=1, le=MAX_CHOICES)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None  # accepted and ignored, as the OpenAI API allows
    # edgeinfer's own samplers, as extra fields
    top_k: StrictInt | None = _ranged(0)
    min_p: Real | None = _ranged(0, 1)
    repetition_penalty: Real | None = _ranged(None, None, exclusiveMinimum=0)
    ignore_eos: StrictBool | None = None  # exactly max_tokens tokens (benchmarks; llama.cpp's server takes it too)
    choice: list[StrictStr] | None = None  # the output is one of these strings
    presence_penalty: Real | None = _ranged(-2, 2)
    frequency_penalty: Real | None = _ranged(-2, 2)
    logit_bias: dict[str, Real] | None = _described(LOGIT_BIAS)  # token id: bias
    response_format: dict[str, Any] | None = _described(RESPONSE_FORMAT)  # checked by GenerationConfig
    speculative: Literal["prompt_lookup", "draft"] | None = None  # draft where the server has a --draft model
    num_speculative_tokens: StrictInt | None = _ranged(1, 32)
    # defined by OpenAI, not served yet (NOT_YET): present only so that the 400 can name them
    functions: Any = _described(NOT_SERVED)
    function_call: Any = _described(NOT_SERVED)

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, body):
        """Refuse what JSON allows and text does not (a lone surrogate such as "\\ud800"), and
        nesting deeper than MAX_DEPTH, naming where."""
        check_json(body)
        return body

    def settings(self) -> dict:
        """The generation settings asked for (the model's defaults apply to the rest)."""
        unsupported = [name for name in NOT_YET if getattr(self, name, None) is not None]
        if unsupported:
            raise RequestError(f"'{unsupported[0]}' is not supported by edgeinfer yet: leave it out", unsupported[0])
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise RequestError("max_tokens and max_completion_tokens differ: send one of them", "max_tokens")
        chosen = {
            "max_new_tokens": self.asked_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "ignore_eos": self.ignore_eos,
            "choice": self.choice,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias,
            "response_format": self.response_format,
            "speculative": self.speculative,
            "num_speculative_tokens": self.num_speculative_tokens,
            **self.logprob_settings(),
        }
        return {name: value for name, value in chosen.items() if value is not None}

    def choice_settings(self) -> list[dict]:
        """The settings of each of the `n` choices: choice i samples with seed + i (the request's
        seed is choice 0's), so every choice is reproducible and they differ."""
        settings = self.settings()
        if "seed" not in settings:
            return [settings] * (self.n or 1)
        return [{**settings, "seed": (settings["seed"] + i) % (SEED_MAX + 1)} for i in range(self.n or 1)]

    @property
    def asked_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_settings(self) -> dict:
        return {}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = _ranged(0, 20)
    # OpenAI's function tools, checked by the SDK (sdk/tools.py) with its own messages
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # the chat template's own variables ({"enable_thinking": false}), as vLLM and llama.cpp's server take them
    chat_template_kwargs: dict[str, Any] | None = None
    # a reasoning model's thought ends after this many tokens (vLLM's name for it)
    thinking_token_budget: StrictInt | None = Field(default=None, ge=0)

    # OpenAI's: "none" turns thinking off where the template has the switch; the other levels change nothing
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    def template_kwargs(self) -> dict:
        off = {"enable_thinking": False} if self.reasoning_effort == "none" else {}
        return {**off, **template_variables(self.chat_template_kwargs)}

    def settings(self) -> dict:
        budget = {} if self.thinking_token_budget is None else {"reasoning_budget": self.thinking_token_budget}
        return {**super().settings(), **budget}

    def tool_request(self) -> ToolRequest | None:
        """The tools asked for, checked; None without tools."""
        if self.tools is None:
            if self.tool_choice is not None:
                raise RequestError("tool_choice needs tools: send the tools it chooses from", "tool_choice")
            return None
        return tool_request(self.tools, self.tool_choice, self.parallel_tool_calls is True)  # several calls only when asked

    def logprob_settings(self) -> dict:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        return {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs}

    def conversation(self) -> list[dict]:
        return check_answers([m.as_dict() for m in self.messages], "messages")


TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Request):
    """`prompt` is one prompt (text or token ids) or a list of them: each gets its `n` choices,
    numbered prompt by prompt, as OpenAI numbers them."""

    prompt: (
        Annotated[StrictStr, Field(min_length=1)]
        | TokenIds
        | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)  # the legacy API: how many alternatives per token
    suffix: Any = _described(NOT_SERVED)
    echo: Any = _described(NOT_SERVED)
    best_of: Any = _described(NOT_SERVED)

    def logprob_settings(self) -> dict:
        return {} if self.logprobs is None else {"logprobs": True, "top_logprobs": self.logprobs}

    def prompts(self) -> list[str | list[int]]:
        one = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if one else list(self.prompt)


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request; `truncate` (edgeinfer's) embeds an input longer than the
    context by its first tokens instead of refusing it."""

    model: StrictStr
    input: (
        Annotated[StrictStr, Field(min_length=1)]
        | TokenIds
        | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1)
    user: StrictStr | None = None  # accepted and ignored, as the OpenAI API allows
    truncate: StrictBool = False


def embedding_reply(model: str, embeddings, encoding_format: str) -> dict:
    """OpenAI's embeddings response: one entry per input, in order, and the tokens read."""
    vectors = embeddings.base64() if encoding_format == "base64" else [v.tolist() for v in embeddings.vectors]
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
        "model": model,
        "usage": {"prompt_tokens": embeddings.prompt_tokens, "total_tokens": embeddings.prompt_tokens},
    }


def _message(result: GenerationResult) -> dict:
    """A chat choice's message: its text, the calls it made (content null where it only called),
    and a reasoning model's thought in reasoning_content."""
    message = {"role": "assistant", "content": result.text}
    if result.tool_calls:
        message = {"role": "assistant", "content": result.text or None, "tool_calls": [c.as_openai() for c in result.tool_calls]}
    return message if result.reasoning is None else {**message, "reasoning_content": result.reasoning}


def _cut(result: GenerationResult) -> dict:
    """A choice that ended inside a tool call says so, beside finish_reason "length" (or "stop"): the
    call (its index in the stream, id, name and arguments as far as they came) is not among its
    tool_calls, which hold whole calls only."""
    cut = result.cut_tool_call
    return {} if cut is None else {"cut_tool_call": {"index": len(result.tool_calls or []), **cut.as_openai()}}


def _delta_of(part: Part) -> dict:
    if isinstance(part, Said):
        return {"content" if part.kind == "text" else "reasoning_content": part.text}
    if isinstance(part, CallOpened):
        opened = {"index": part.index, "id": part.id, "type": "function", "function": {"name": part.name, "arguments": ""}}
        return {"tool_calls": [opened]}
    return {"tool_calls": [{"index": part.index, "function": {"arguments": part.text}}]}


class Reply:
    """The response to one request in OpenAI's shape, one choice per request made for it: whole,
    or as stream chunks (api.Reply: each chunk a bare `data:` event, then `[DONE]`). ChatReply
    ("chat.completion") and CompletionReply ("text_completion") say how a choice's output, its
    logprobs and a chunk's delta look."""

    PREFIX, OBJECT, CHUNK_OBJECT = "", "", ""

    def __init__(
        self,
        model: str,
        token_bytes: Callable[[int], bytes] | None = None,
        system_fingerprint: str | None = None,
        choices: int = 1,
        per_prompt: int = 1,
        include_usage: bool = False,
    ):
        """`token_bytes` gives a token's bytes, for logprobs; `per_prompt` choices share a prompt
        (n), whose tokens usage counts once; `include_usage` ends a stream with a usage chunk."""
        self.model, self.token_bytes = model, token_bytes
        self.fingerprint, self.per_prompt, self.include_usage = system_fingerprint, per_prompt, include_usage
        self.offsets = [0] * choices  # characters of text sent so far, per choice (the completions API's text_offset)
        self.id = self.PREFIX + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    @classmethod
    def of(cls, body, served: Served) -> Reply:
        """The reply to `body` (api.Api.reply): one choice per request made, n of them per prompt."""
        per_prompt = body.n or 1
        return cls(served.model, served.tokenizer.token_bytes, served.fingerprint, served.requests, per_prompt, body.include_usage)

    def whole(self, results: list[GenerationResult]) -> dict:
        choices = [
            {"index": index, "finish_reason": FINISH[result.finish_reason], "logprobs": self._logprobs(result.logprobs, index)}
            | self._output(result)
            | _cut(result)
            for index, result in enumerate(results)
        ]
        return {**self._head(self.OBJECT), "choices": choices, "usage": self.usage(results)}

    def opening(self) -> list[Event]:
        return []

    def delta(self, index: int, delta: ChatDelta) -> list[Event]:
        """A piece's text as it comes, with its logprobs."""
        piece = delta.piece
        if not piece.text:
            return []
        logprobs = self._logprobs(piece.logprobs, index)
        self.offsets[index] += len(piece.text)
        return [(None, self._chunk(index, self._said(piece.text), None, logprobs))]

    def closing(self, index: int, result: GenerationResult) -> list[Event]:
        last = self._chunk(index, self._said(None), FINISH[result.finish_reason])
        last["choices"][0] |= _cut(result)
        return [(None, last)]

    def ending(self, results: list[GenerationResult]) -> list[Event]:
        usage = {**self._head(self.CHUNK_OBJECT), "choices": [], "usage": self.usage(results)}
        return [*([(None, usage)] if self.include_usage else []), (None, "[DONE]")]

    def error_event(self, status: int, body: dict) -> Event:
        return None, body

    def usage(self, results: list[GenerationResult]) -> dict:
        """OpenAI's usage over the choices: each prompt's tokens once (with those the prefix
        cache held), every choice's completion tokens; in `completion_tokens_details`, a reasoning
        model's thought tokens, and with speculative decoding the proposed tokens kept and rejected
        as OpenAI reports a prediction's."""
        firsts = results[:: self.per_prompt]
        prompt, made = sum(r.prompt_tokens for r in firsts), sum(len(r.token_ids) for r in results)
        counts = {
            "prompt_tokens": prompt,
            "completion_tokens": made,
            "total_tokens": prompt + made,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)},
        }
        images = sum(r.image_tokens for r in firsts)
        if images:  # the prompt's tokens that stood for its images
            counts["prompt_tokens_details"]["image_tokens"] = images
        details = {}
        if any(r.reasoning is not None for r in results):
            details["reasoning_tokens"] = sum(r.reasoning_tokens for r in results)
        proposed = [r for r in results if r.proposed_tokens is not None]
        if proposed:
            accepted = sum(last.accepted_tokens for last in proposed)
            details["accepted_prediction_tokens"] = accepted
            details["rejected_prediction_tokens"] = sum(last.proposed_tokens for last in proposed) - accepted
        return counts | ({"completion_tokens_details": details} if details else {})

    def _token(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def _chunk(self, index: int, delta, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        choice = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs} | self._delta(delta)
        return {**self._head(self.CHUNK_OBJECT), "choices": [choice]}

    def _head(self, kind: str) -> dict:
        """What the response and every chunk of the stream carry."""
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint}


class ChatReply(Reply):
    """Chat Completions: a choice's `message`, chunks' `delta`, logprobs' `content` list; a stream
    opens with the assistant's role."""

    PREFIX, OBJECT, CHUNK_OBJECT = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def opening(self) -> list[Event]:
        return [(None, self._chunk(i, {"role": "assistant", "content": ""}, None)) for i in range(len(self.offsets))]

    def delta(self, index: int, delta: ChatDelta) -> list[Event]:
        """A chat turn's delta (sdk/chat_stream.py) as chunks: the thought in reasoning_content, the
        text in content, each call as the openai client's stream helpers accumulate them (its index,
        id, type and name first, then its arguments as they come). The piece's logprobs ride on its
        first chunk (on an empty one where the piece said nothing yet)."""
        logprobs = self._logprobs(delta.piece.logprobs, index) if delta.piece is not None else None
        chunks = []
        for part in delta.parts:
            chunks.append((None, self._chunk(index, _delta_of(part), None, logprobs)))
            logprobs = None
        if logprobs is not None:
            chunks.append((None, self._chunk(index, {"content": ""}, None, logprobs)))
        return chunks

    def _output(self, result: GenerationResult) -> dict:
        return {"message": _message(result)}

    def _said(self, text: str | None) -> dict:
        return {} if text is None else {"content": text}

    def _delta(self, delta) -> dict:
        return {"delta": delta}

    def _logprobs(self, logprobs: list[TokenLogprob] | None, index: int) -> dict | None:
        if logprobs is None:
            return None
        entry = lambda t, lp: {"token": self._token(t), "logprob": lp, "bytes": list(self.token_bytes(t))}  # noqa: E731
        return {"content": [{**entry(c.token, c.logprob), "top_logprobs": [entry(t, lp) for t, lp in c.top]} for c in logprobs]}


class CompletionReply(Reply):
    """Completions: a choice's `text`, chunks' `text`, logprobs' parallel lists (tokens,
    token_logprobs, top_logprobs, text_offset)."""

    PREFIX, OBJECT, CHUNK_OBJECT = "cmpl-", "text_completion", "text_completion"

    def _output(self, result: GenerationResult) -> dict:
        return {"text": result.text}

    def _said(self, text: str | None) -> str:
        return text or ""

    def _delta(self, delta) -> dict:
        return {"text": delta}

    def _logprobs(self, logprobs: list[TokenLogprob] | None, index: int) -> dict | None:
        if logprobs is None:
            return None
        offsets, at = [], self.offsets[index]
        for c in logprobs:
            offsets.append(at)
            at += len(self._token(c.token))
        return {
            "tokens": [self._token(c.token) for c in logprobs],
            "token_logprobs": [c.logprob for c in logprobs],
            "top_logprobs": [{self._token(t): lp for t, lp in c.top} for c in logprobs],
            "text_offset": offsets,
        }


CHAT = Api(
    "/v1/chat/completions",
    ChatRequest,
    "messages",
    API_NAMES,
    conversation=lambda body, store: body.conversation(),
    reply=ChatReply.of,
)
COMPLETIONS = Api("/v1/completions", CompletionRequest, "prompt", API_NAMES, reply=CompletionReply.of)
EMBEDDINGS = Api("/v1/embeddings", EmbeddingRequest, "input", API_NAMES)
