"""A chat turn: a conversation made into what generation takes, in one place for every caller
(Engine.chat and stream_chat, the CLI through them, and every API route of the server). It plans
the tools (tools.py), renders the chat template, lets a reasoning model think before a call it
must make (tools.thought_first), and gives each output of the turn its settings and the
ChatStream that splits it. Nothing else renders a template for a chat or plans tools."""

from __future__ import annotations

from dataclasses import dataclass

from .chat_stream import ChatStream
from .errors import SettingsError
from .reasoning import ReasoningFormat, reasoning_format
from .tokenizer import Tokenizer
from .tools import ToolCall, ToolPlan, ToolRequest, plan, thought_first
from .vision import Picture, expand, name_pictures, take_pictures


@dataclass(frozen=True)
class ChatTurn:
    """`ids`: the prompt (the conversation as the template renders it, `text`); `plan`: the tools'
    plan, where the turn has tools; `thinking`: a reasoning model's markers, read off the
    rendered text; `constraint`: what the plan constrains every output to (a call it must make),
    the thought first where the model thinks; `pictures`: the conversation's images, whose
    features the prompt's picture ids name (sdk/vision.py), to be encoded before it runs."""

    tokenizer: Tokenizer
    text: str
    ids: list[int]
    plan: ToolPlan | None
    thinking: ReasoningFormat | None
    constraint: dict | None
    pictures: tuple[Picture, ...] = ()

    def settings(self, settings: dict, config=None) -> dict:
        """One output's settings with the plan's constraint; a response_format or choice of its own
        (in `settings`, or in the GenerationConfig `config`) cannot stand beside it."""
        if self.constraint is None:
            return settings
        if any(value is not None for value in (settings.get("response_format"), settings.get("choice"), config and config.constraint)):
            raise SettingsError("response_format and choice cannot constrain a turn that must call a tool", "response_format")
        return {**settings, "response_format": self.constraint}

    def stream(self) -> ChatStream:
        """A new splitter of one output of the turn (its thought, its text, its calls)."""
        return ChatStream(self.tokenizer, self.plan, self.thinking)


def chat_turn(
    tokenizer: Tokenizer,
    context: int,
    messages: list[dict],
    request: ToolRequest | None = None,
    template_kwargs: dict | None = None,
    vision: dict | None = None,
) -> ChatTurn:
    """The turn of `messages` with the tools `request` asks for (None: none), within `context`
    tokens; `template_kwargs` are the chat template's own variables; `vision` the manifest's,
    for a model that takes images. Raises SettingsError on a bad tool request, a bad image or a
    prompt that leaves no room."""
    messages, pictures = take_pictures(_as_dicts(messages), vision)
    chosen = plan(tokenizer, messages, request) if request is not None else None
    rewrite = (lambda text: expand(text, vision, pictures)) if pictures else None
    text, ids = tokenizer.chat_prompt(
        chosen.messages if chosen else messages, context, chosen and chosen.tools, template_kwargs, rewrite
    )
    if pictures:
        ids = name_pictures(ids, vision, pictures)
    thinking = reasoning_format(tokenizer, text)
    constraint = chosen.response_format if chosen is not None else None
    if constraint is not None and thinking is not None:
        constraint = thought_first(constraint, thinking)
    return ChatTurn(tokenizer, text, ids, chosen, thinking, constraint, tuple(pictures))


def closed_text(
    tokenizer: Tokenizer, messages: list[dict], request: ToolRequest | None = None, template_kwargs: dict | None = None
) -> str:
    """The conversation as the template closes it, no reply opened (llama.cpp's /apply-template
    without a generation prompt), its tools planned as a turn of it plans them."""
    messages = _as_dicts(messages)
    chosen = plan(tokenizer, messages, request) if request is not None else None
    return tokenizer.render_chat(chosen.messages if chosen else messages, False, chosen and chosen.tools, template_kwargs)


def _as_dicts(messages: list[dict]) -> list[dict]:
    """`messages` with an assistant's `tool_calls` in OpenAI's shape: they may be the ToolCall
    objects a result carries (`result.tool_calls`), sent back as they came."""
    if not isinstance(messages, (list, tuple)):
        return messages  # the tokenizer says what messages must be

    def plain(message):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not calls or not isinstance(calls, (list, tuple)):
            return message
        return {**message, "tool_calls": [c.as_openai() if isinstance(c, ToolCall) else c for c in calls]}

    return [plain(m) for m in messages]
