"""The contract of an API plug-in. Each API the server speaks (openai.py: Chat Completions,
Completions and Embeddings; responses.py; anthropic.py) declares one `Api`: its request side (the
body, the field that holds the prompt, its names for the SDK's settings, how its body becomes the
SDK's messages) and its reply side (a `Reply` that turns the neutral ChatDelta of each output into
its response, whole or as events, and an error into its shape). apis.py holds the table of them;
app.py runs every generation API through one route."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from edgeinfer.sdk.chat_stream import ChatDelta
from edgeinfer.sdk.sequence import GenerationResult

Event = tuple[str | None, dict | str]  # a server-sent event: (its name, its data); no name is a bare `data:` line


@dataclass(frozen=True)
class Served:
    """What a reply is made from besides its body: the model's name as replies carry it, the
    backend's tokenizer, the export's fingerprint, the prompt's tokens (a chat turn's), the outputs
    asked for (`requests`), and the server's store of responses (responses.Store)."""

    model: str
    tokenizer: Any
    fingerprint: str | None
    prompt_tokens: int
    requests: int
    store: Any = None


class Reply(Protocol):
    """One response of an API. Output `index` is the request made for it (a choice of n, a prompt
    of a completion); the others have one."""

    id: str

    def opening(self) -> list[Event]:
        """The stream's first events, before any output."""

    def delta(self, index: int, delta: ChatDelta) -> list[Event]:
        """The events of what one piece of output `index` adds."""

    def closing(self, index: int, result: GenerationResult) -> list[Event]:
        """The events that end output `index`."""

    def ending(self, results: list[GenerationResult]) -> list[Event]:
        """The stream's last events, once every output has ended."""

    def whole(self, results: list[GenerationResult]) -> dict:
        """The response, not streamed."""

    def error_event(self, status: int, body: dict) -> Event:
        """The event that ends a stream an error stopped (`body` in OpenAI's error shape)."""


def openai_shape(status: int, body: dict) -> dict:
    return body


@dataclass(frozen=True)
class Api:
    """One API: its `path`; its `request` body (and the other `bodies` under the path, such as a
    token count's); `prompt_field`, the body's field an error about the prompt names; `names`, the
    body's fields of SDK settings named otherwise; `error_shape`, an error body in OpenAI's shape
    made this API's. A generation API has a `reply` (body, Served) -> Reply, and either a
    `conversation` (body, store) -> the SDK's messages (a chat turn) or none (the body's
    `prompts()`, tokenized as they are); an API without a reply has a route of its own."""

    path: str
    request: type[BaseModel]
    prompt_field: str
    names: dict[str, str]
    error_shape: Callable[[int, dict], dict] = openai_shape
    conversation: Callable[[Any, Any], list[dict]] | None = None
    reply: Callable[[Any, Served], Reply] | None = None
    bodies: tuple[type[BaseModel], ...] = field(default=())
