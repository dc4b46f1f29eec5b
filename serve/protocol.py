"""OpenAI's wire format: request bodies as pydantic models, their translation into edgeinfer's
generation settings, and the responses, stream chunks and errors in OpenAI's shape. Nothing here
knows of HTTP or of the scheduler."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeinfer.sdk.errors import BusyError, ContextLengthError, EdgeInferError, GenerationError, GraphError, UnavailableError
from edgeinfer.sdk.sampling import TokenLogprob
from edgeinfer.sdk.sequence import GenerationResult, Piece
from edgeinfer.sdk.settings import FIELDS

# Fields OpenAI defines that edgeinfer does not serve yet: a 400 naming the field, never ignored.
NOT_YET = ("tools", "tool_choice", "functions", "function_call", "suffix", "echo", "best_of")
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as the OpenAI API allows
    # edgeinfer's own samplers, as extra fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None  # exactly max_tokens tokens (benchmarks; llama.cpp's server takes it too)
    choice: list[str] | None = None  # the output is one of these strings
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None  # checked by GenerationConfig: OpenAI's types and edgeinfer's regex, grammar
    speculative: str | None = None  # "prompt_lookup", or "draft" where the server has a --draft model
    num_speculative_tokens: int | None = None
    # defined by OpenAI, not served yet (NOT_YET): present only so that the 400 can name them
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None

    def settings(self) -> dict:
        """The generation settings asked for (the model's defaults apply to the rest)."""
        unsupported = [name for name in NOT_YET if getattr(self, name, None) is not None]
        if unsupported:
            raise RequestError(f"'{unsupported[0]}' is not supported by edgeinfer yet: leave it out", unsupported[0])
        if self.n not in (None, 1):
            raise RequestError(f"n={self.n} is not supported: edgeinfer makes one choice per request (n=1); send "
                               "several requests instead", "n")
        if self.max_tokens is not None and self.max_completion_tokens is not None and self.max_tokens != self.max_completion_tokens:
            raise RequestError("max_tokens and max_completion_tokens differ: send one of them", "max_tokens")
        chosen = {"max_new_tokens": self.max_completion_tokens or self.max_tokens, "temperature": self.temperature,
                  "top_p": self.top_p, "seed": self.seed, "stop": self.stop, "top_k": self.top_k, "min_p": self.min_p,
                  "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos, "choice": self.choice,
                  "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                  "logit_bias": self.logit_bias, "response_format": self.response_format, "speculative": self.speculative,
                  "num_speculative_tokens": self.num_speculative_tokens, **self.logprob_settings()}
        return {name: value for name, value in chosen.items() if value is not None}

    def logprob_settings(self) -> dict:
        return {}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def logprob_settings(self) -> dict:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        return {"logprobs": self.logprobs, "top_logprobs": self.top_logprobs}

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Request):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)  # the legacy API: how many alternatives per token

    def logprob_settings(self) -> dict:
        return {} if self.logprobs is None else {"logprobs": True, "top_logprobs": self.logprobs}
    suffix: Any = None
    echo: Any = None
    best_of: Any = None


class RequestError(Exception):
    """A request the server refuses before it reaches the engine."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_edgeinfer(error: EdgeInferError, prompt_field: str = "messages") -> tuple[int, dict, dict]:
    """(status, body, headers) of an edgeinfer error, its message carried through; `prompt_field`
    is the request field that holds the prompt."""
    if isinstance(error, BusyError):
        return 429, error_body(str(error), "rate_limit_exceeded", code="queue_full"), {"Retry-After": "1"}
    if isinstance(error, UnavailableError):
        return 503, error_body(str(error), "server_error", code="engine_unavailable"), {"Retry-After": "1"}
    if isinstance(error, ContextLengthError):
        return 400, error_body(f"{error} (prompt {error.prompt_tokens} tokens, context {error.context})",
                               param=prompt_field, code="context_length_exceeded"), {}
    if isinstance(error, GraphError) or not isinstance(error, GenerationError):
        return 500, error_body(str(error), "server_error"), {}
    return 400, error_body(str(error), param=_setting_named(str(error))), {}


def _setting_named(message: str) -> str | None:
    """The request field an engine message is about: its settings messages start with the setting's name."""
    first = message.split(" ", 1)[0]
    return {"max_new_tokens": "max_tokens"}.get(first, first) if first in FIELDS else None


class Reply:
    """The response to one request, in OpenAI's shape for chat ("chat.completion") or completions
    ("text_completion"): whole, or as stream chunks."""

    def __init__(self, chat: bool, model: str, token_bytes: Callable[[int], bytes] | None = None):
        """`token_bytes` gives a token's bytes, for logprobs."""
        self.chat, self.model, self.token_bytes = chat, model, token_bytes
        self.offset = 0  # characters of text sent so far (the completions API's text_offset)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def whole(self, result: GenerationResult) -> dict:
        choice = {"index": 0, "finish_reason": FINISH[result.finish_reason], "logprobs": self._logprobs(result.logprobs)}
        choice |= {"message": {"role": "assistant", "content": result.text}} if self.chat else {"text": result.text}
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": [choice],
                "usage": usage(result.prompt_tokens, len(result.token_ids), result)}

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant's role."""
        return self._chunk({"role": "assistant", "content": ""}, None) if self.chat else None

    def piece_chunk(self, piece: Piece) -> dict:
        logprobs = self._logprobs(piece.logprobs)
        self.offset += len(piece.text)
        return self._chunk({"content": piece.text} if self.chat else piece.text, None, logprobs)

    def last_chunk(self, finish_reason: str) -> dict:
        return self._chunk({} if self.chat else "", FINISH[finish_reason])

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        """OpenAI's logprobs of some tokens: chat's `content` list, or the completions API's
        parallel lists (tokens, token_logprobs, top_logprobs, text_offset)."""
        if logprobs is None:
            return None
        token = lambda t: self.token_bytes(t).decode("utf-8", errors="replace")  # noqa: E731
        if self.chat:
            entry = lambda t, lp: {"token": token(t), "logprob": lp, "bytes": list(self.token_bytes(t))}  # noqa: E731
            return {"content": [{**entry(c.token, c.logprob), "top_logprobs": [entry(t, lp) for t, lp in c.top]}
                                for c in logprobs]}
        offsets, at = [], self.offset
        for c in logprobs:
            offsets.append(at)
            at += len(token(c.token))
        return {"tokens": [token(c.token) for c in logprobs], "token_logprobs": [c.logprob for c in logprobs],
                "top_logprobs": [{token(t): lp for t, lp in c.top} for c in logprobs], "text_offset": offsets}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, last: Piece | None = None) -> dict:
        return {**self._chunk_head(), "choices": [], "usage": usage(prompt_tokens, completion_tokens, last)}

    def _chunk(self, delta, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
        choice |= {"delta": delta} if self.chat else {"text": delta}
        return {**self._chunk_head(), "choices": [choice]}

    def _chunk_head(self) -> dict:
        """What every chunk of the stream repeats: chat chunks are "chat.completion.chunk"."""
        return {"id": self.id, "object": self.object + ".chunk" if self.chat else self.object, "created": self.created,
                "model": self.model}


def usage(prompt_tokens: int, completion_tokens: int, last: GenerationResult | Piece | None = None) -> dict:
    """OpenAI's usage; with speculative decoding, the proposed tokens kept and rejected as OpenAI's
    `completion_tokens_details` reports those of a prediction."""
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
    if last is not None and last.proposed_tokens is not None:
        counts["completion_tokens_details"] = {"accepted_prediction_tokens": last.accepted_tokens,
                                               "rejected_prediction_tokens": last.proposed_tokens - last.accepted_tokens}
    return counts
