"""Reasoning models, which think before they answer (`<think>...</think>`, as Qwen3, SmolLM3 and the
DeepSeek-R1 distills write it): the reasoning is split from the answer, whole or as it streams.
The markers are read off the chat template (or the vocabulary); a template's own switch
(`enable_thinking`) is one of the `chat_template_kwargs` a call passes through."""

from __future__ import annotations

from dataclasses import dataclass

MARKERS = (("<think>", "</think>"),)


@dataclass(frozen=True)
class ReasoningFormat:
    opening: str
    closing: str
    opened_by_prompt: bool = False  # the generation prompt ends with the opening: the output starts inside it


def reasoning_format(tokenizer, prompt_text: str | None = None) -> ReasoningFormat | None:
    """The markers a model thinks between, where its template or vocabulary names them (as text
    that decoding keeps: a marker that is a special token is dropped from the text, and not split)."""
    template = tokenizer.chat_template or ""
    for opening, closing in MARKERS:
        named = opening in template or tokenizer.token_id(opening) is not None
        if named and opening not in tokenizer.special_tokens:
            opened = prompt_text is not None and prompt_text.rstrip().endswith(opening)
            return ReasoningFormat(opening, closing, opened)
    return None


class ReasoningSplitter:
    """Splits streamed text into ("reasoning", text) and ("content", text) parts as it comes,
    holding back only text that may still be the start of a marker."""

    def __init__(self, format: ReasoningFormat):
        self.format = format
        self.state = "reasoning" if format.opened_by_prompt else "start"
        self.held, self.trim = "", True  # trim: the next part starts a section (its leading newlines go)
        self.entered = False

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        parts = []
        while True:
            if self.state == "start":
                stripped = self.held.lstrip()
                if stripped.startswith(self.format.opening):
                    self.held, self.state, self.trim = stripped[len(self.format.opening) :], "reasoning", True
                    self.entered = True
                    continue
                if stripped and not self.format.opening.startswith(stripped):
                    self.state, self.trim = "content", False  # no thought: the text stays as it is
                    continue
                return parts  # nothing yet, or what may still become the opening
            if self.state == "reasoning":
                at = self.held.find(self.format.closing)
                if at >= 0:
                    self._emit(parts, "reasoning", self.held[:at])
                    self.held, self.state, self.trim = self.held[at + len(self.format.closing) :], "content", True
                    continue
                keep = partial_suffix(self.held, self.format.closing)
                self._emit(parts, "reasoning", self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                return parts
            self._emit(parts, "content", self.held)
            self.held = ""
            return parts

    @property
    def thought(self) -> bool:
        """Whether the output thought (it opened a thought, or started inside one)."""
        return self.format.opened_by_prompt or self.entered

    def flush(self) -> list[tuple[str, str]]:
        parts = []
        self._emit(parts, "content" if self.state != "reasoning" else "reasoning", self.held)
        self.held = ""
        return parts

    def _emit(self, parts: list, kind: str, text: str) -> None:
        if self.trim:
            text = text.lstrip("\n")
            if not text:
                return
            self.trim = False
        if text:
            parts.append((kind, text))


class ReasoningBudget:
    """Ends a thought after `tokens` tokens: the tokens of its closing marker (`closing_ids`) are
    then forced, one a step, and the answer follows."""

    def __init__(self, format: ReasoningFormat, tokens: int, closing_ids: list[int]):
        self.splitter, self.left, self.closing_ids = ReasoningSplitter(format), tokens, list(closing_ids)
        self.forced: list[int] = []
        self.spent = False  # the closing was forced once: the budget is done
        self._check()

    def next_token(self) -> int | None:
        """The token that must come next, or None where the model chooses."""
        return self.forced[0] if self.forced else None

    def add(self, token: int, text: str) -> None:
        """Take the token chosen and the text it added."""
        if self.forced and self.forced[0] == token:
            self.forced.pop(0)
        inside = self.splitter.state == "reasoning"
        self.splitter.feed(text)
        if inside:
            self.left -= 1
        self._check(whole=bool(text))

    def _check(self, whole: bool = True) -> None:
        """Force the closing once the budget is spent, at a character's end (`whole`: the last token
        ended one; the marker cannot follow part of a character)."""
        if self.splitter.state == "reasoning" and self.left <= 0 and not self.spent and whole:
            self.forced, self.spent = list(self.closing_ids), True


def split_reasoning(text: str, format: ReasoningFormat) -> tuple[str | None, str]:
    """(the reasoning, or None where the output has none; the answer) of a whole output."""
    splitter = ReasoningSplitter(format)
    parts = [*splitter.feed(text), *splitter.flush()]
    reasoning = "".join(t for kind, t in parts if kind == "reasoning")
    thought = format.opened_by_prompt or text.lstrip().startswith(format.opening)
    return (reasoning if thought else None), "".join(t for kind, t in parts if kind == "content")


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
