"""`edgeinfer chat`: a conversation in the terminal, kept across turns, replies streamed (a
reasoning model's thought on stderr, apart from the reply)."""

from __future__ import annotations

import sys

import click

from edgeinfer.sdk.errors import GenerationError
from edgeinfer.sdk.settings import resolve_settings

from .options import GENERATION_OPTIONS, MODEL_OPTIONS, generation_settings, in_flags, with_options
from .resolve import load_engine, say

HELP = "type a message and press Enter; /reset starts over; /exit, Ctrl-D or Ctrl-C ends"


class Conversation:
    """The messages so far. Where the rendered conversation would leave less than `reply_room`
    tokens of the context for the reply, the oldest exchanges are dropped (the system message stays)."""

    def __init__(self, engine, system: str | None, reply_room: int):
        self.engine = engine
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict] = []
        self.reply_room = reply_room

    def ask(self, text: str) -> list[dict]:
        """Add a user message; the conversation's messages, ready for the reply."""
        self.turns.append({"role": "user", "content": text})
        ids = self.engine.chat_prompt(self.system + self.turns)
        while len(ids) + self.reply_room > self.engine.max_context and len(self.turns) > 1:
            del self.turns[:2]  # the oldest user message and its reply
            say("(the conversation is longer than the model's context: the oldest exchange was dropped)")
            ids = self.engine.chat_prompt(self.system + self.turns)
        return self.system + self.turns

    def answer(self, text: str) -> None:
        self.turns.append({"role": "assistant", "content": text})

    def undo(self) -> None:
        """Forget the last user message (its reply failed or was interrupted)."""
        self.turns.pop()

    def reset(self) -> None:
        self.turns.clear()


@click.command()
@with_options(MODEL_OPTIONS)
@with_options(GENERATION_OPTIONS)
@click.option("--system", default=None, help="A system message that starts the conversation.")
def chat(model, provider, threads, max_context, memory_limit, prefix_cache, draft, chat_template, system, **params):
    """Chat with the model in the terminal. Replies stream as they are made; Ctrl-C during a
    reply stops that reply."""
    engine = load_engine(model, provider, threads, max_context, memory_limit, prefix_cache, draft=draft, chat_template=chat_template)
    config = resolve_settings(engine.default_config, None, generation_settings(params, draft))
    conversation = Conversation(engine, system, reply_room=min(config.max_new_tokens, engine.max_context // 4))
    say(f"chatting with {engine.manifest.source}: {HELP}")
    while (text := _read_line()) is not None:
        command = text.strip()
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            conversation.reset()
            say("(conversation cleared)")
        elif command:
            _reply(engine, conversation, text, config)


def _read_line() -> str | None:
    """The user's next line, or None at EOF or Ctrl-C (also when Ctrl-C comes as the prompt is shown)."""
    try:
        click.echo("> ", nl=False, err=True)
        return input()
    except (EOFError, KeyboardInterrupt):
        click.echo(err=True)
        return None


def _reply(engine, conversation: Conversation, text: str, config) -> None:
    try:
        reply, thinking = [], False
        for delta in engine.stream_chat(conversation.ask(text), config):
            if delta.reasoning:  # a reasoning model's thought: on stderr, dimmed, kept out of the conversation
                thinking = True
                click.echo(click.style(delta.reasoning, dim=True), nl=False, err=True)
            if delta.text:
                if thinking:
                    click.echo(err=True)
                    thinking = False
                click.echo(delta.text, nl=False)
                sys.stdout.flush()
                reply.append(delta.text)
        click.echo()
        conversation.answer("".join(reply))
    except KeyboardInterrupt:
        click.echo()
        say("(reply interrupted)")
        conversation.undo()
    except GenerationError as e:
        say(f"error: {in_flags(e)}")
        conversation.undo()
