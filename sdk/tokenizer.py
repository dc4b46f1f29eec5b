"""Text to token ids and back with the `tokenizers` library, and the model's chat template
rendered with jinja2 in a sandbox (no transformers)."""
from __future__ import annotations

import json
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
