"""One chat turn as it streams: each piece of the output split into a reasoning model's thought,
the reply's text and the tool calls (a call's id and name first, then its arguments as they are
generated). A whole output goes through the same split, so a stream's deltas join to the whole
turn, and every API (the SDK's stream_chat, chat completions, Responses, Messages) reads the
same parts."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from .reasoning import ReasoningFormat, ReasoningSplitter
from .sequence import GenerationResult, Piece
from .tokenizer import Detokenizer, Tokenizer
from .tool_parser import CallParser, Part, Said
from .tools import GENERIC, ToolPlan


@dataclass
class ChatDelta:
    """What one piece of a chat turn adds, as `parts` in order (tool_parser's Said, the reasoning
    or the text; CallOpened; CallArguments). The last delta has the `finish_reason` and the whole
    turn's `result`."""

    parts: list[Part]
    token_ids: list[int]
    finish_reason: str | None = None
    result: GenerationResult | None = None
    piece: Piece | None = field(default=None, repr=False)

    @property
    def text(self) -> str:
        """The reply's text this piece adds."""
        return said(self.parts, "text")

    @property
    def reasoning(self) -> str:
        """The thought this piece adds."""
        return said(self.parts, "reasoning")


class ChatStream:
    """Splits one output of a chat turn: `thinking` (a reasoning model's markers, or None), `plan`
    (a turn with tools, or None)."""

    def __init__(self, tokenizer: Tokenizer, plan: ToolPlan | None = None, thinking: ReasoningFormat | None = None):
        self.plan = plan
        self.splitter = ReasoningSplitter(thinking) if thinking is not None else None
        parses = plan is not None and not (plan.format.name == GENERIC and plan.response_format is None)
        self.calls = CallParser(plan.format) if parses else None
        markers = "" if plan is None else plan.format.opening + plan.format.closing
        self.special = {t for t in tokenizer.special_tokens if t and t in markers}
        # a call marker that is a special token is text only where special tokens are decoded
        self.detokenizer = Detokenizer(tokenizer, keep_special=True) if self.special else None
        others = sorted(set(tokenizer.special_tokens) - self.special, key=len, reverse=True) if self.special else []
        self.others = re.compile("|".join(map(re.escape, others))) if others else None  # dropped from the text
        self.pieces: list[Piece] = []
        self.said: list[Part] = []
        self.reasoning_tokens = 0  # tokens generated while the thought was open

    def feed(self, piece: Piece) -> ChatDelta:
        self.pieces.append(piece)
        final = piece.finish_reason is not None
        inside = self.splitter is not None and self.splitter.state == "reasoning"
        if self.detokenizer is None:
            text = piece.text
        else:
            text = "".join(self.detokenizer.add(t) for t in piece.token_ids) + (self.detokenizer.flush() if final else "")
        parts = self._split(text, final)
        if inside or said(parts, "reasoning"):
            self.reasoning_tokens += len(piece.token_ids)
        delta = ChatDelta(parts, piece.token_ids, piece.finish_reason, piece=piece)
        if final:
            delta.result = self._result(GenerationResult.from_pieces(self.pieces))
        return delta

    def replay(self, pieces: list[Piece]) -> GenerationResult:
        """The whole turn of an output's pieces, split as its stream is."""
        for piece in pieces:
            delta = self.feed(piece)
        return delta.result

    def _split(self, text: str, final: bool) -> list[Part]:
        if self.others is not None:
            text = self.others.sub("", text)
        if self.splitter is None:
            sections = [Said("text", text)] if text else []
        else:
            split = [*self.splitter.feed(text), *(self.splitter.flush() if final else [])]
            sections = [Said("reasoning" if kind == "reasoning" else "text", t) for kind, t in split]
        parts: list[Part] = []
        for section in sections:
            parts += self.calls.feed(section.text) if section.kind == "text" and self.calls is not None else [section]
        if final and self.calls is not None:
            parts += self.calls.finish()
        self.said += parts
        return parts

    def _result(self, result: GenerationResult) -> GenerationResult:
        text = said(self.said, "text")
        thought = self.splitter is not None and self.splitter.thought
        reasoning = said(self.said, "reasoning") if thought else None
        if self.plan is None:
            return replace(result, text=text, reasoning=reasoning, reasoning_tokens=self.reasoning_tokens)
        calls = self.calls.tool_calls if self.calls is not None else []
        cut = self.calls.cut_call if self.calls is not None else None
        reason = "tool_calls" if calls and not cut and result.finish_reason != "length" else result.finish_reason
        return replace(
            result,
            text=text,
            reasoning=reasoning,
            reasoning_tokens=self.reasoning_tokens,
            tool_calls=calls,
            cut_tool_call=cut,
            finish_reason=reason,
            tool_format=self.plan.format.name,
        )


def said(parts: list[Part], kind: str) -> str:
    """The text of the parts of `kind` ("text" or "reasoning"), joined."""
    return "".join(p.text for p in parts if isinstance(p, Said) and p.kind == kind)


def chat_deltas(stream: ChatStream, pieces: Iterator[Piece]) -> Iterator[ChatDelta]:
    """`pieces` of one output as ChatDeltas; closing it closes `pieces` (which stops the work)."""
    try:
        for piece in pieces:
            yield stream.feed(piece)
    finally:
        pieces.close()
