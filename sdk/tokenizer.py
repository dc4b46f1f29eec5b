"""Text to token ids and back with the `tokenizers` library, and the model's chat template
rendered with jinja2 in a sandbox (no transformers)."""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Tokenizer

from .errors import GenerationError, NotAnExportError
from .manifest import TokenizerSpec


class Tokenizer:
    def __init__(self, folder: Path, spec: TokenizerSpec):
        path = Path(folder) / spec.file
        if not path.is_file():
            raise NotAnExportError(f"{path} is missing: the export is incomplete, export the model again")
        try:
            self._tokenizer = _Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise NotAnExportError(f"{path} cannot be read ({e}): export the model again") from None
        self.spec = spec
        self.chat_template = (Path(folder) / spec.chat_template).read_text() if spec.chat_template else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

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

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered by the chat template, ready for a reply."""
        if not isinstance(messages, (list, tuple)) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages):
            raise GenerationError('messages must be a non-empty list of {"role": str, "content": str} dicts')
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as the model's chat template writes it."""
        if self.chat_template is None:
            raise GenerationError("this model has no chat template: pass a plain prompt instead of messages")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.spec.bos_token or "", eos_token=self.spec.eos_token or "",
            )
        except TemplateError as e:
            raise GenerationError(f"the chat template rejected the messages: {e}") from None


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
        added = tokenizer.get_added_tokens_decoder()
        tokens = [b""] * tokenizer.get_vocab_size(with_added_tokens=True)
        for text, index in tokenizer.get_vocab(with_added_tokens=True).items():
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
    characters, so every piece is valid text and the pieces join to the full decode."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the window that is decoded again for context
        self.read = 0  # tokens already turned into text

    def add(self, token: int) -> str:
        self.ids.append(token)
        return self._advance()

    def _advance(self) -> str:
        done = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(done) :]
        return ""

    def flush(self) -> str:
        """Whatever is left at the end, incomplete characters included."""
        done = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(done) :]
