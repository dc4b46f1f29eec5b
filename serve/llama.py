"""llama.cpp's server endpoints that clients use for budgets, logit_bias and model discovery, in
its shapes: `POST /tokenize`, `/detokenize`, `/apply-template` and `GET /props`. `/tokenize` also
takes vLLM's forms (a `prompt`, or chat `messages` rendered as a reply's prompt, answering `count`
and `max_model_len` beside llama.cpp's `tokens`), so it counts a chat's tokens. Request bodies are
strict, as the OpenAI routes' are; `model` picks one of several models served. Nothing here knows
of HTTP or of the scheduler."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, model_validator

from edgeinfer.sdk.tools import ToolRequest, tool_request

from .checks import RequestError
from .openai import Message


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeRequest(_Strict):
    """Exactly one of `content` (llama.cpp's), `prompt` (vLLM's) or `messages` (a chat, as the
    template renders it for the next reply, tools and template variables included)."""

    model: StrictStr | None = None
    content: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special: StrictBool | None = None  # llama.cpp's name: BOS where the model starts a text with it
    add_special_tokens: StrictBool | None = None  # vLLM's name for it
    with_pieces: StrictBool = False  # each token as {"id", "piece"}

    @model_validator(mode="after")
    def _one_text(self):
        given = [name for name in ("content", "prompt", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("send exactly one of content (text), prompt (text) or messages (a chat)")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go with messages: the chat template renders them")
        return self

    @property
    def adds_special(self) -> bool:
        """Special tokens around plain text: llama.cpp's add_special (default off), else vLLM's (default on)."""
        if self.add_special is not None:
            return self.add_special
        return self.add_special_tokens if self.add_special_tokens is not None else self.content is None

    def conversation(self) -> list[dict]:
        return [m.as_dict() for m in self.messages]

    def tool_request(self) -> ToolRequest | None:
        """The tools offered as a chat turn offers them (tool_choice auto); none for an empty list, as llama.cpp reads it."""
        return tool_request(self.tools, None, True) if self.tools else None


class DetokenizeRequest(_Strict):
    model: StrictStr | None = None
    tokens: list[StrictInt]


class ApplyTemplateRequest(_Strict):
    """The prompt the chat template writes for `messages` (llama.cpp's /apply-template)."""

    model: StrictStr | None = None
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True  # False: the conversation closed, no reply begun

    conversation = TokenizeRequest.conversation
    tool_request = TokenizeRequest.tool_request


REQUESTS = (TokenizeRequest, DetokenizeRequest, ApplyTemplateRequest)


def tokens_reply(ids: list[int], token_bytes, context: int, with_pieces: bool) -> dict:
    """llama.cpp's `tokens` (with pieces: each {"id", "piece"}, the piece its text, or its bytes
    where they are not UTF-8 alone) and vLLM's `count` and `max_model_len`."""
    tokens = [{"id": i, "piece": _piece(token_bytes(i))} for i in ids] if with_pieces else ids
    return {"tokens": tokens, "count": len(ids), "max_model_len": context}


def _piece(raw: bytes) -> str | list[int]:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def check_ids(ids: list[int], vocab_size: int) -> None:
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is not in this model's vocabulary of {vocab_size} (0 to {vocab_size - 1})", "tokens")


def props_reply(name: str, backend, version: str) -> dict:
    """llama.cpp's /props: the model's context, rows, chat template and default settings."""
    config = getattr(backend, "default_config", None) or getattr(getattr(backend, "engine", None), "default_config", None)
    params = {} if config is None else {k: getattr(config, k) for k in ("temperature", "top_k", "top_p", "min_p", "max_new_tokens")}
    if "max_new_tokens" in params:
        params["n_predict"] = params.pop("max_new_tokens")
    return {
        "default_generation_settings": {"n_ctx": backend.max_context, "params": params},
        "total_slots": getattr(backend, "max_batch", 1),
        "model_alias": name,
        "model_path": str(getattr(backend, "folder", name)),
        "chat_template": backend.tokenizer.chat_template or "",
        "modalities": {"vision": False, "audio": False},
        "build_info": f"edgeinfer {version}",
    }
