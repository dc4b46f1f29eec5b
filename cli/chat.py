"""`edgeinfer chat`: a conversation in the terminal, kept across turns, replies streamed (a
reasoning model's thought on stderr, apart from the reply). Lines that start with / are commands
(COMMANDS), never sent to the model; three double quotes on a line open and close a message of several lines; on a
terminal, the line editor keeps a history, and what is typed during a reply is not shown in it."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import click

from edgeinfer.models import cache_root
from edgeinfer.sdk.errors import EdgeInferError, GenerationError, SettingsError
from edgeinfer.sdk.settings import resolve_settings
from edgeinfer.sdk.vision import open_image, user_message

from .options import GENERATION_OPTIONS, MODEL_OPTIONS, generation_settings, in_flags, with_options
from .resolve import QUIET, load_engine, say, say_timings

HELP = 'type a message and press Enter (""" opens and closes several lines); /help lists the commands'
COMMANDS = {
    "/help": "this list",
    "/set NAME VALUE": "a setting for the next replies: temperature, top_p, top_k, min_p, max_new_tokens, seed, system",
    "/image FILE": "a picture (PNG, JPEG, WebP, GIF, BMP) sent with the next message (a vision-language model)",
    "/show": "the settings and the conversation's length",
    "/save FILE": "the conversation as JSON (its messages)",
    "/load FILE": "a conversation saved by /save (or any JSON list of messages), in place of this one",
    "/reset": "start over (/clear too)",
    "/bye": "end (/exit, /quit, Ctrl-D; Ctrl-C during a reply stops that reply)",
}
SETTABLE = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "max_new_tokens": int, "seed": int}


class Conversation:
    """The messages so far. Where the rendered conversation would leave less than `reply_room`
    tokens of the context for the reply, the oldest exchanges are dropped (the system message stays)."""

    def __init__(self, engine, system: str | None, reply_room: int):
        self.engine = engine
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict] = []
        self.reply_room = reply_room
        self.images: list[str] = []  # pictures attached to the next message (/image)

    def ask(self, text: str) -> list[dict]:
        """Add a user message (with the pictures attached); the conversation's messages, ready for the reply."""
        self.turns.append(user_message(text, self.images))
        self.images = []
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

    def messages(self) -> list[dict]:
        return self.system + self.turns

    def replace(self, messages: list[dict]) -> None:
        """The conversation of `messages` (a system message first stays the system message)."""
        self.system = [messages[0]] if messages and messages[0].get("role") == "system" else []
        self.turns = list(messages[len(self.system) :])


@click.command()
@with_options(MODEL_OPTIONS)
@with_options(GENERATION_OPTIONS)
@click.option("--system", default=None, help="A system message that starts the conversation.")
def chat(model, provider, threads, max_context, memory_limit, prefix_cache, draft, chat_template, system, **params):
    """Chat with the model in the terminal. Replies stream as they are made; Ctrl-C during a
    reply stops that reply; /help lists the commands."""
    engine = load_engine(model, provider, threads, max_context, memory_limit, prefix_cache, draft=draft, chat_template=chat_template)
    if engine.tokenizer.chat_template is None:
        raise SettingsError(
            f"{engine.manifest.source} has no chat template, so it cannot hold a conversation: give it one "
            "(--chat-template FILE), or continue a text with `edgeinfer run --raw`"
        )
    settings = generation_settings(params, draft)
    config = resolve_settings(engine.default_config, None, settings)
    conversation = Conversation(engine, system, reply_room=min(config.max_new_tokens, engine.max_context // 4))
    say(f"chatting with {engine.manifest.source}: {HELP}")
    with _line_history():
        while (text := _read_message()) is not None:
            if text.strip().startswith("/"):
                if not _command(text.strip(), conversation, settings, engine):
                    break
                config = resolve_settings(engine.default_config, None, settings)
            elif text.strip():
                _reply(engine, conversation, text, config)


def _command(line: str, conversation: Conversation, settings: dict, engine) -> bool:
    """Carry out a / command; False where it ends the chat."""
    name, _, rest = line.partition(" ")
    if name in ("/bye", "/exit", "/quit"):
        return False
    if name == "/help":
        say("\n".join(f"  {usage:<16} {what}" for usage, what in COMMANDS.items()))
    elif name in ("/reset", "/clear"):
        conversation.reset()
        say("(conversation cleared)")
    elif name == "/set":
        _set(rest.strip(), conversation, settings, engine)
    elif name == "/show":
        shown = ", ".join(f"{k} {v}" for k, v in sorted(settings.items()) if k in SETTABLE) or "the model's defaults"
        say(f"settings: {shown}; {len(conversation.turns)} messages" + (", a system message" if conversation.system else ""))
    elif name == "/image" and rest.strip():
        _attach(Path(rest.strip()).expanduser(), conversation, engine)
    elif name in ("/save", "/load") and rest.strip():
        _save_or_load(name, Path(rest.strip()).expanduser(), conversation)
    else:
        say(f"{line!r} is not a command here (/help lists them); to send it to the model, start it with a space")
    return True


def _attach(path: Path, conversation: Conversation, engine) -> None:
    """A picture for the next message, checked now (read, decoded, the model takes images)."""
    if not engine.manifest.vision:
        say(f"{engine.manifest.source} reads text only: pictures need a vision-language export")
        return
    try:
        open_image(str(path), "image")
    except SettingsError as e:
        say(f"error: {e}")
        return
    conversation.images.append(str(path))
    say(f"({path.name} goes with your next message)")


def _set(words: str, conversation: Conversation, settings: dict, engine) -> None:
    name, _, value = words.partition(" ")
    if name == "system":
        conversation.system = [{"role": "system", "content": value}] if value else []
        say("(system message set)" if value else "(system message removed)")
        return
    if name not in SETTABLE or not value:
        say(f"/set takes NAME VALUE, NAME one of {', '.join([*SETTABLE, 'system'])}")
        return
    try:
        tried = {**settings, name: SETTABLE[name](value)}
        resolve_settings(engine.default_config, None, tried)  # the SDK's checks, in its words
    except ValueError:
        say(f"{name} takes {'an integer' if SETTABLE[name] is int else 'a number'}, not {value!r}")
        return
    except EdgeInferError as e:
        say(f"error: {e}")
        return
    settings.update(tried)
    say(f"({name} {tried[name]})")


def _save_or_load(name: str, path: Path, conversation: Conversation) -> None:
    try:
        if name == "/save":  # written beside it, then renamed: a file is never left half-written
            partial = path.with_name(f".{path.name}.partial")
            partial.write_text(json.dumps(conversation.messages(), ensure_ascii=False, indent=1) + "\n")
            partial.replace(path)
            say(f"(saved {len(conversation.messages())} messages to {path})")
            return
        messages = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        say(f"error: {path}: {getattr(e, 'strerror', None) or e}")
        return
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        say(f'error: {path} is not a JSON list of messages ({{"role", "content"}} objects), as /save writes')
        return
    conversation.replace(messages)
    say(f"(loaded {len(messages)} messages from {path})")


def _read_message() -> str | None:
    """The user's next message: a line, or the lines between two \"\"\" lines; None at EOF or Ctrl-C."""
    first = _read_line("> ")
    if first is None or first.strip() != '"""':
        return first
    lines = []
    while (line := _read_line(". ")) is not None and line.strip() != '"""':
        lines.append(line)
    return "\n".join(lines)


def _read_line(prompt: str) -> str | None:
    """The user's next line, or None at EOF or Ctrl-C (also when Ctrl-C comes as the prompt is shown).
    On a terminal the line editor shows the prompt itself, once it reads keys (a key typed as a
    prompt printed beforehand appears would be echoed raw, ^[[A); through a pipe it goes to stderr,
    apart from the replies."""
    try:
        if sys.stdin.isatty():
            return input(prompt)
        click.echo(prompt, nl=False, err=True)
        return input()
    except (EOFError, KeyboardInterrupt):
        click.echo(err=True)
        return None


@contextlib.contextmanager
def _line_history():
    """On a terminal: the line editor (arrows, history across chats, in the cache's chat_history)."""
    if not sys.stdin.isatty():
        yield
        return
    try:
        import readline
    except ImportError:  # a Python without it: plain input
        yield
        return
    path = cache_root() / "chat_history"
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.set_history_length(1000)
            readline.write_history_file(path)


@contextlib.contextmanager
def _keys_unshown():
    """On a terminal, keys typed while a reply streams are neither shown in it nor sent after it."""
    try:
        import termios
    except ImportError:
        termios = None
    if termios is None or not sys.stdin.isatty():
        yield
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)
        termios.tcflush(fd, termios.TCIFLUSH)


def _reply(engine, conversation: Conversation, text: str, config) -> None:
    try:
        with _keys_unshown():
            reply = _streamed(engine.stream_chat(conversation.ask(text), config))
        conversation.answer(reply.text)
        if QUIET["verbose"]:  # -v: the reply's speed
            say_timings(reply)
    except KeyboardInterrupt:
        click.echo()
        say("(reply interrupted)")
        conversation.undo()
    except GenerationError as e:
        say(f"error: {in_flags(e)}")
        conversation.undo()


def _streamed(deltas):
    """The reply on stdout as it comes, a reasoning model's thought dimmed on stderr; its result."""
    thinking = False
    for delta in deltas:
        if delta.reasoning:  # kept out of the conversation
            thinking = True
            click.echo(click.style(delta.reasoning, dim=True), nl=False, err=True)
        if delta.text:
            if thinking:
                click.echo(err=True)
                thinking = False
            click.echo(delta.text, nl=False)
            sys.stdout.flush()
    click.echo()
    return delta.result
