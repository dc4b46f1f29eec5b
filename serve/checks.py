"""What every API's requests and errors share: the strict JSON checks a body passes (text only, bounded
nesting, images refused by name, tool results that answer a call), the refusal a route raises
(RequestError), and an engine error in OpenAI's error shape, in the words of the API asked
(`from_edgeinfer`; each API reshapes it: api.py). Nothing here knows of HTTP or of the scheduler."""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Strict

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


MAX_DEPTH = 512  # levels of nesting in a request body (a JSON schema's included; Python's own limit is 1000)
SEED_MAX = 2**63 - 1
Real = Annotated[float, Strict()]  # a JSON number (an integer too), never a string or a boolean


class RequestError(Exception):
    """A request the server refuses before it reaches the engine."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ImagePart(BaseModel):
    """An image in a tool result (Anthropic's image block there), read only so that it is refused
    by name: a tool result is given to the template as text."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_image", "image"]


def refuse_images(content) -> None:
    """ValueError naming the first image part of a tool result's content, with the way out."""
    image = next((part for part in content if isinstance(part, ImagePart)), None) if isinstance(content, list) else None
    if image is not None:
        raise ValueError(f"an {image.type} block in a tool result: a tool result is text; send the image in a user message after it")


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


SDK_TRUNCATE = ", or pass truncate='left' to keep its end"


def from_edgeinfer(error: EdgeInferError, prompt_field: str, names: dict[str, str]) -> tuple[int, dict, dict]:
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


def api_name(setting: str, names: dict[str, str]) -> str:
    """The request field of an SDK setting's name ("max_new_tokens" is max_tokens; "logit_bias[5]" is logit_bias)."""
    root = setting.split("[")[0]
    return names.get(root, root)


def fingerprint(*parts: str) -> str:
    """OpenAI's system_fingerprint: what served the request (edgeinfer's version and the export)."""
    return "fp_" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]
