"""Text to token ids and back with the `tokenizers` library, and the model's chat template
rendered with jinja2 in a sandbox (no transformers)."""

from __future__ import annotations

import functools
import json
import numbers
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Tokenizer

from .errors import ContextLengthError, GenerationError, NotAnExportError, SettingsError
from .manifest import TokenizerSpec


class Tokenizer:
    def __init__(self, folder: Path, spec: TokenizerSpec):
        path = Path(folder) / spec.file
        if not path.is_file():
            raise NotAnExportError(f"{path} is missing: the export is incomplete, export the model again")
        try:
            self._tokenizer = _Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on a malformed file, nothing narrower
            raise NotAnExportError(f"{path} cannot be read ({e}): export the model again") from None
        self.spec = spec
        self.chat_template = (Path(folder) / spec.chat_template).read_text() if spec.chat_template else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. A lone surrogate (valid in a JSON string, not in text) is a
        GenerationError. Long texts are encoded without holding the GIL (the batch call releases
        it), so other threads (a server's event loop) keep running."""
        if not text.isascii():
            _check_text(text)
        if len(text) < _LONG_TEXT:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_within(self, text: str, context: int, add_special_tokens: bool = True) -> list[int]:
        """`encode`, refusing at once (ContextLengthError) a text too long to leave room in a
        context of `context` tokens: encoding megabytes would take seconds."""
        if (least := self.min_tokens(text)) >= context:
            raise ContextLengthError(
                f"the prompt has at least {least} tokens ({len(text)} characters) but the context is {context}: shorten it",
                least,
                context,
            )
        return self.encode(text, add_special_tokens)

    def prompt_ids(self, prompt: str | list[int], vocab_size: int, context: int | None = None, pictures=None) -> list[int]:
        """A prompt's token ids (text is encoded, ids are checked against the vocabulary, or are
        picture ids `pictures`, an ImageStore, holds); with `context`, text that cannot leave room
        in it is refused before it is encoded."""
        if isinstance(prompt, str):
            ids = self.encode(prompt) if context is None else self.encode_within(prompt, context)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, numbers.Integral) for t in prompt):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < vocab_size and not (pictures is not None and pictures.holds(t))]
            if bad:
                raise GenerationError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")
        else:
            raise GenerationError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise GenerationError("the prompt is empty: pass some text or token ids")
        return ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of `text`, without encoding it: no token spells more than
        `longest_token` bytes, and normalization is taken to at most halve the bytes."""
        return len(text.encode("utf-8", errors="surrogatepass")) // (2 * self.longest_token)

    @functools.cached_property
    def longest_token(self) -> int:
        """The most bytes one token's text holds, as the vocabulary writes it (added tokens included)."""
        return max(len(text.encode()) for text in self._tokenizer.get_vocab(with_added_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    @functools.cached_property
    def vocabulary(self) -> Vocabulary:
        """Each token's bytes, as decoding writes them (constraints and logprobs need them)."""
        return Vocabulary.of(self._tokenizer)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token adds to the text (a byte-level token may hold part of a character);
        none for special tokens and ids the tokenizer does not know, which add no text."""
        vocabulary = self.vocabulary
        return b"" if token >= len(vocabulary.tokens) or token in vocabulary.special else vocabulary.tokens[token]

    def token_id(self, text: str | None) -> int | None:
        """The id of a token given by its text (a special token's), or None."""
        return None if text is None else self._tokenizer.token_to_id(text)

    def chat_ids(
        self, messages: list[dict], context: int | None = None, tools: list[dict] | None = None, template_kwargs: dict | None = None
    ) -> list[int]:
        """Token ids of a conversation rendered by the chat template (`chat_prompt`)."""
        return self.chat_prompt(messages, context, tools, template_kwargs)[1]

    def chat_prompt(
        self,
        messages: list[dict],
        context: int | None = None,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
        rewrite=None,
    ) -> tuple[str, list[int]]:
        """(text, token ids) of a conversation rendered by the chat template, ready for a reply
        (refused at once where they cannot leave room in a context of `context` tokens), with
        `template_kwargs` as the template's own variables (enable_thinking, say). An assistant
        message may have `content` None where it has `tool_calls`, as OpenAI's do; a content may be
        a list of parts (images, sdk/vision.py), which `rewrite` makes into their text once rendered."""
        if not isinstance(messages, (list, tuple)) or not messages or not all(_is_message(m) for m in messages):
            raise GenerationError('messages must be a non-empty list of {"role": str, "content": str} dicts')
        if any(m.get("tool_calls") for m in messages) and "tool_calls" not in (self.chat_template or ""):
            raise GenerationError(
                "this model's chat template does not render tool calls, so an assistant message with "
                "tool_calls cannot be shown to it: send the calls' text as the message's content"
            )
        text = self._turn_text(messages, tools, template_kwargs)
        text = rewrite(text) if rewrite is not None else text
        return text, (self.encode(text, False) if context is None else self.encode_within(text, context, False))

    def _turn_text(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None) -> str:
        """The rendered prompt of the next reply; where the last message is the assistant's own text
        (a prefill), the reply continues that message: the conversation as the template closes it,
        cut right after the message's text (as transformers' continue_final_message does)."""
        last = messages[-1]
        if last["role"] != "assistant" or not last.get("content") or last.get("tool_calls"):
            return self.render_chat(messages, tools=tools, template_kwargs=template_kwargs)
        closed = self.render_chat(messages, add_generation_prompt=False, tools=tools, template_kwargs=template_kwargs)
        for said in (last["content"], last["content"].strip()):
            at = closed.rfind(said) if said else -1
            if at >= 0:
                return closed[: at + len(said)]
        raise GenerationError(
            "this model's chat template rewrites the last assistant message, so the reply cannot continue it: "
            "send the conversation without the assistant's partial message"
        )

    def use_template(self, template: str) -> None:
        """Render conversations with `template` (Jinja, as transformers' chat_template) in place of
        the export's own; SettingsError where it does not parse."""
        try:
            _environment().parse(template)
        except TemplateError as e:
            where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
            raise SettingsError(
                f"the chat template does not parse{where}: {e.message}: fix it and load it again", "chat_template"
            ) from None
        self.chat_template = template

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
    ) -> str:
        """The conversation as the model's chat template writes it, with `tools` (OpenAI's function
        tools) given to the template as transformers gives them; a call's arguments sent as JSON
        text are given to it as the object they spell, as templates expect."""
        if self.chat_template is None:
            raise GenerationError("this model has no chat template: pass a plain prompt instead of messages")
        variables = {
            **_today(),
            **template_variables(template_kwargs),
            "messages": [_with_argument_objects(m) for m in messages],
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.spec.bos_token or "",
            "eos_token": self.spec.eos_token or "",
        }
        try:
            return _environment().from_string(self.chat_template).render(variables)  # one dict: any name is a variable ("self" too)
        except TemplateError as e:
            raise GenerationError(f"the chat template rejected the messages: {e}") from None
        except Exception as e:  # noqa: BLE001 - a template is code the export brings: what it raises refuses these messages
            raise GenerationError(
                f"the chat template failed on the messages ({type(e).__name__}: {e}): send them in a form it takes "
                "(content as text, not null), or give the model another template (chat_template=FILE)"
            ) from None

    def decode_all(self, ids: list[int]) -> str:
        """The text of `ids` with the special tokens' own text kept (a tool call's markers may be special tokens)."""
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    @functools.cached_property
    def special_tokens(self) -> dict[str, int]:
        """Each special token's text and id."""
        vocabulary = self.vocabulary
        return {vocabulary.tokens[i].decode(errors="replace"): i for i in vocabulary.special}


def _with_argument_objects(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                call = {**call, "function": {**function, "arguments": json.loads(arguments)}}
            except ValueError:
                pass
        converted.append(call)
    return {**message, "tool_calls": converted}


def _today() -> dict[str, str]:
    """The dates llama.cpp gives every template, which some read instead of calling strftime_now
    (Llama 3's `date_string`, else "26 Jul 2024"); chat_template_kwargs may set them."""
    now = datetime.now()
    return {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y")}


def _environment() -> ImmutableSandboxedEnvironment:
    """The sandbox chat templates run in, with the filters and functions transformers gives them."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


TEMPLATE_INPUTS = (
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
)  # set by edgeinfer, never by chat_template_kwargs


def template_variables(value) -> dict:
    """`chat_template_kwargs` checked: a dict of the template's own variables, none of which is one
    that edgeinfer sets from the request (SettingsError naming the key otherwise)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise SettingsError(f"chat_template_kwargs must be a dict of the template's variables, got {value!r}", "chat_template_kwargs")
    taken = [k for k in TEMPLATE_INPUTS if k in value]
    if taken:
        raise SettingsError(
            f"chat_template_kwargs.{taken[0]} is set from the request itself ({', '.join(TEMPLATE_INPUTS)} are): "
            f"send it as the request's own field, or leave it out of chat_template_kwargs",
            "chat_template_kwargs",
        )
    return value


_LONG_TEXT = 4096  # characters: shorter texts are encoded holding the GIL (the batch call costs more)


def _is_message(m) -> bool:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return False
    content = m.get("content")
    parts = isinstance(content, list) and all(isinstance(p, dict) for p in content)
    return isinstance(content, str) or parts or (content is None and bool(m.get("tool_calls")))


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GenerationError(
            f"the text holds a lone surrogate ({text[e.start]!r} at character {e.start}), which is not "
            "a character: send text whose \\uD800-\\uDFFF escapes come in pairs"
        ) from None


def _raise_template_error(message: str):
    raise TemplateError(message)


# GPT-2's byte-level alphabet: the printable character that stands for each byte in a vocabulary.
_PRINTABLE = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
_BYTE_OF = {chr(b): b for b in _PRINTABLE} | {chr(256 + i): b for i, b in enumerate(b for b in range(256) if b not in _PRINTABLE)}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class Vocabulary:
    """`tokens[id]`: the bytes token `id` adds to the text (special tokens: their own text, and
    listed in `special`). Read from the vocabulary, not from decoding one token at a time, which
    loses the bytes of a token that holds part of a character."""

    tokens: list[bytes]
    special: frozenset[int]

    @classmethod
    def of(cls, tokenizer: _Tokenizer) -> Vocabulary:
        spec = json.loads(tokenizer.to_str())
        byte_level = _declares(spec.get("decoder"), "ByteLevel") or _declares(spec.get("pre_tokenizer"), "ByteLevel")
        added, vocab = tokenizer.get_added_tokens_decoder(), tokenizer.get_vocab(with_added_tokens=True)
        # ids may run past the counted size (Gemma 3's GGUF vocabulary has holes): the list spans them all
        tokens = [b""] * max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        for text, index in vocab.items():
            tokens[index] = added[index].content.encode() if index in added else _token_bytes(text, byte_level)
        return cls(tokens, frozenset(i for i, token in added.items() if token.special))


def _token_bytes(text: str, byte_level: bool) -> bytes:
    if (byte := _BYTE_TOKEN.fullmatch(text)) is not None:  # SentencePiece's byte fallback
        return bytes([int(byte.group(1), 16)])
    if byte_level and all(c in _BYTE_OF for c in text):
        return bytes(_BYTE_OF[c] for c in text)
    return text.replace("\u2581", " ").encode()  # SentencePiece's word start


def _declares(part, kind: str) -> bool:
    """Whether a tokenizer.json part (a decoder, a pre-tokenizer, or a sequence of them) has `kind`."""
    if isinstance(part, dict):
        return part.get("type") == kind or any(_declares(v, kind) for v in part.values())
    if isinstance(part, list):
        return any(_declares(v, kind) for v in part)
    return False


class Detokenizer:
    """Turns tokens into text one at a time, holding back bytes until they form whole
    characters, so every piece is valid text and the pieces join to the full decode. With
    `keep_special`, special tokens are text too (a tool call's markers may be special tokens)."""

    def __init__(self, tokenizer: Tokenizer, keep_special: bool = False):
        self.decode = tokenizer.decode_all if keep_special else tokenizer.decode
        self.ids: list[int] = []
        self.prefix = 0  # start of the window that is decoded again for context
        self.read = 0  # tokens already turned into text

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._advance()

    def _advance(self) -> str:
        done = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(done) :]
        return ""

    def flush(self) -> str:
        """Whatever is left at the end, incomplete characters included."""
        done = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(done) :]
