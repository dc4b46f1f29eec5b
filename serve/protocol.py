"""OpenAI's wire format: request bodies as pydantic models, their translation into edgeinfer's
generation settings, and the responses, stream chunks and errors in OpenAI's shape. Nothing here
knows of HTTP or of the scheduler.

Types are strict, as OpenAI's are: `max_tokens: true` or `stream: "yes"` is a 400, not 1 or True.
The numeric ranges the SDK checks are written into the OpenAPI description (JSON schema's
`minimum`, `maximum`), and the SDK's own message answers a value outside them."""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr, model_validator

from edgeinfer.sdk.errors import (
    BusyError,
    ConstraintError,
    ContextLengthError,
    EdgeInferError,
    GenerationError,
    GraphError,
    SettingsError,
    UnavailableError,
)
from edgeinfer.sdk.chat_stream import ChatDelta
from edgeinfer.sdk.sampling import TokenLogprob
from edgeinfer.sdk.sequence import GenerationResult, Piece
from edgeinfer.sdk.tokenizer import template_variables
from edgeinfer.sdk.tool_parser import CallOpened, Part, Said
from edgeinfer.sdk.tools import ToolRequest, tool_request

# Fields OpenAI defines that edgeinfer does not serve yet: a 400 naming the field, never ignored.
NOT_YET = ("functions", "function_call", "suffix", "echo", "best_of")
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "tool_calls": "tool_calls"}
MAX_CHOICES = 16  # n
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_DEPTH = 512  # levels of nesting in a request body (a JSON schema's included; Python's own limit is 1000)
SEED_MAX = 2**63 - 1
# The SDK's names of settings whose API field is named otherwise.
API_NAMES = {"max_new_tokens": "max_tokens", "reasoning_budget": "thinking_token_budget"}

Real = Annotated[float, Strict()]  # a JSON number (an integer too), never a string or a boolean


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


class ImagePart(BaseModel):
    """An image in a message (OpenAI's image_url and input_image parts, Anthropic's image block),
    read only so that it is refused by name: the models served read text."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_image", "image"]


def refuse_images(content) -> None:
    """ValueError naming the first image part of a message's content, with the way out."""
    image = next((part for part in content if isinstance(part, ImagePart)), None) if isinstance(content, list) else None
    if image is not None:
        raise ValueError(
            f"an {image.type} part: this model reads text only and cannot be sent images; describe the image in a text part"
        )


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
    content: StrictStr | list[TextPart | ImagePart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None  # an assistant's earlier thought, as vLLM and llama.cpp take it

    @model_validator(mode="after")
    def _has_content(self):
        refuse_images(self.content)
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
        text = self.content if self.content is None or isinstance(self.content, str) else "".join(p.text for p in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": text}
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
        return tool_request(self.tools, self.tool_choice, True if self.parallel_tool_calls is None else self.parallel_tool_calls)

    def logprob_settings(self) -> dict:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        return {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs}

    def conversation(self) -> list[dict]:
        return check_answers([m.as_dict() for m in self.messages], "messages")


def check_answers(messages: list[dict], field: str) -> list[dict]:
    """`messages` (the SDK's), where every tool result answers a call an earlier assistant message
    made, as OpenAI's and Anthropic's APIs require; RequestError naming the call id otherwise."""
    made: set[str] = set()
    for message in messages:
        made.update(call["id"] for call in message.get("tool_calls") or [])
        if message["role"] == "tool" and message["tool_call_id"] not in made:
            raise RequestError(
                f"a tool result answers call {message['tool_call_id']!r}, which no earlier assistant message made: "
                "send the call (with that id) before its result, or leave the result out",
                field,
            )
    return messages


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


def check_json(value, where: str = "", depth: int = 0) -> None:
    """RequestError (naming the field) for a lone surrogate anywhere in a JSON value, or nesting
    past MAX_DEPTH. Iterative, so no value can exhaust Python's stack."""
    stack = [(value, where, depth)]
    while stack:
        item, path, level = stack.pop()
        if level > MAX_DEPTH:
            where = path if len(path) < 80 else f"{path[:60]}…"
            raise RequestError(f"{where or 'the body'} is nested more than {MAX_DEPTH} levels deep: flatten it", _root(path))
        if isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, dict):
            for key, inner in item.items():
                _check_text(key, path)
                stack.append((inner, f"{path}.{key}" if path else str(key), level + 1))
        elif isinstance(item, list):
            stack.extend((inner, f"{path}[{i}]", level + 1) for i, inner in enumerate(item))


def _check_text(text: str, path: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(
                f"{path or 'the body'} holds a lone surrogate (\\u{ord(text[e.start]):04x} at character "
                f"{e.start}), which is not text: send UTF-8 text, its \\uD800-\\uDFFF escapes in pairs",
                path or None,
            ) from None


def _root(path: str) -> str | None:
    return path.split(".")[0].split("[")[0] or None


class RequestError(Exception):
    """A request the server refuses before it reaches the engine."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def check_room(prompt_tokens: int, asked: int | None, context: int) -> None:
    """OpenAI's rule: a prompt plus the max_tokens asked for must fit the context (a request that
    does not ask gets what room there is)."""
    if asked is not None and prompt_tokens < context < prompt_tokens + asked:  # a prompt too long alone: the engine says so
        room = context - prompt_tokens
        way = f"ask for at most {room} tokens" if room > 0 else "shorten the prompt"
        raise RequestError(
            f"the context is {context} tokens, and the prompt's {prompt_tokens} tokens plus max_tokens {asked} "
            f"are {prompt_tokens + asked}: {way}",
            "max_tokens",
            code="context_length_exceeded",
        )


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one request's inputs


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


SDK_TRUNCATE = ", or pass truncate='left' (--truncate left) to keep its end"


def from_edgeinfer(error: EdgeInferError, prompt_field: str = "messages", names: dict = API_NAMES) -> tuple[int, dict, dict]:
    """(status, body, headers) of an edgeinfer error, its message carried through in the API's words
    (`names`: the request field of each SDK setting named otherwise); `prompt_field` is the request
    field that holds the prompt."""
    if isinstance(error, BusyError):
        return 429, error_body(str(error), "rate_limit_exceeded", code=error.code), {"Retry-After": "1"}
    if isinstance(error, UnavailableError):
        return 503, error_body(str(error), "server_error", code="engine_unavailable"), {"Retry-After": "1"}
    if isinstance(error, ContextLengthError):
        # the SDK's way out (truncate='left') is no field of these APIs: the server's is its own
        message = str(error).replace(SDK_TRUNCATE, f" (drop the oldest {'turns' if prompt_field != 'prompt' else 'text'})")
        return (
            400,
            error_body(
                f"{message} (prompt {error.prompt_tokens} tokens, context {error.context})",
                param=prompt_field,
                code="context_length_exceeded",
            ),
            {},
        )
    if isinstance(error, GraphError) or not isinstance(error, GenerationError):
        return 500, error_body(str(error), "server_error"), {}
    param = api_name(error.param, names) if isinstance(error, SettingsError) and error.param else None
    if param is None and not isinstance(error, SettingsError):
        param = "response_format" if isinstance(error, ConstraintError) else prompt_field
    message = str(error)
    for setting, field in names.items():
        message = re.sub(rf"\b{setting}\b", field, message)
    return 400, error_body(message, param=param), {}


def _message(result: GenerationResult) -> dict:
    """A chat choice's message: its text, the calls it made (content null where it only called),
    and a reasoning model's thought in reasoning_content."""
    message = {"role": "assistant", "content": result.text}
    if result.tool_calls:
        message = {"role": "assistant", "content": result.text or None, "tool_calls": [c.as_openai() for c in result.tool_calls]}
    return message if result.reasoning is None else {**message, "reasoning_content": result.reasoning}


def _delta_of(part: Part) -> dict:
    if isinstance(part, Said):
        return {"content" if part.kind == "text" else "reasoning_content": part.text}
    if isinstance(part, CallOpened):
        opened = {"index": part.index, "id": part.id, "type": "function", "function": {"name": part.name, "arguments": ""}}
        return {"tool_calls": [opened]}
    return {"tool_calls": [{"index": part.index, "function": {"arguments": part.text}}]}


def api_name(setting: str, names: dict = API_NAMES) -> str:
    """The request field of an SDK setting's name ("max_new_tokens" is max_tokens; "logit_bias[5]" is logit_bias)."""
    root = setting.split("[")[0]
    return names.get(root, root)


def fingerprint(*parts: str) -> str:
    """OpenAI's system_fingerprint: what served the request (edgeinfer's version and the export)."""
    return "fp_" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


class Reply:
    """The response to one request in OpenAI's shape, one choice per request made for it: whole,
    or as stream chunks. ChatReply ("chat.completion") and CompletionReply ("text_completion")
    say how a choice's output, its logprobs and a chunk's delta look."""

    PREFIX, OBJECT, CHUNK_OBJECT = "", "", ""

    def __init__(
        self,
        model: str,
        token_bytes: Callable[[int], bytes] | None = None,
        system_fingerprint: str | None = None,
        choices: int = 1,
        per_prompt: int = 1,
    ):
        """`token_bytes` gives a token's bytes, for logprobs; `per_prompt` choices share a prompt
        (n), whose tokens usage counts once."""
        self.model, self.token_bytes = model, token_bytes
        self.fingerprint, self.per_prompt = system_fingerprint, per_prompt
        self.offsets = [0] * choices  # characters of text sent so far, per choice (the completions API's text_offset)
        self.id = self.PREFIX + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def whole(self, results: list[GenerationResult]) -> dict:
        choices = [
            {"index": index, "finish_reason": FINISH[result.finish_reason], "logprobs": self._logprobs(result.logprobs, index)}
            | self._output(result)
            for index, result in enumerate(results)
        ]
        return {**self._head(self.OBJECT), "choices": choices, "usage": self.usage(results)}

    def first_chunks(self) -> list[dict]:
        return []

    def piece_chunk(self, index: int, piece: Piece) -> dict:
        logprobs = self._logprobs(piece.logprobs, index)
        self.offsets[index] += len(piece.text)
        return self._chunk(index, self._said(piece.text), None, logprobs)

    def last_chunk(self, index: int, finish_reason: str) -> dict:
        return self._chunk(index, self._said(None), FINISH[finish_reason])

    def usage_chunk(self, results: list[GenerationResult]) -> dict:
        return {**self._head(self.CHUNK_OBJECT), "choices": [], "usage": self.usage(results)}

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

    def first_chunks(self) -> list[dict]:
        return [self._chunk(i, {"role": "assistant", "content": ""}, None) for i in range(len(self.offsets))]

    def delta_chunks(self, index: int, delta: ChatDelta) -> list[dict]:
        """A chat turn's delta (sdk/chat_stream.py) as chunks: the thought in reasoning_content, the
        text in content, each call as the openai client's stream helpers accumulate them (its index,
        id, type and name first, then its arguments as they come). The piece's logprobs ride on its
        first chunk (on an empty one where the piece said nothing yet)."""
        logprobs = self._logprobs(delta.piece.logprobs, index) if delta.piece is not None else None
        chunks = []
        for part in delta.parts:
            chunks.append(self._chunk(index, _delta_of(part), None, logprobs))
            logprobs = None
        if logprobs is not None:
            chunks.append(self._chunk(index, {"content": ""}, None, logprobs))
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
