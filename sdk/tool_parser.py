"""Tool calls read out of a reply as it is generated: the text before a call is said as it comes,
each call's name once it is whole, and its arguments piece by piece, as OpenAI's and Anthropic's
streams send them. A whole reply is read the same way, so a stream's pieces join to the whole.

The reader holds back only what may still be the start of the format's opening marker (and the
whitespace before it); from the marker on, the calls are read a character at a time by their
syntax's reader (tool_syntax/). Text from a marker on that holds no call is said as text when the
reply ends.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from .reasoning import partial_suffix
from .tool_syntax import SYNTAXES
from .tool_syntax.json_calls import StringReader
from .tools import GENERIC, ToolCall, ToolFormat


@dataclass(frozen=True)
class Said:
    """Text a turn says: its reply (`kind` "text") or its thought ("reasoning")."""

    kind: str
    text: str


@dataclass(frozen=True)
class CallOpened:
    """A tool call whose name is whole: its place among the turn's calls, its id and its name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """More of a call's arguments (JSON text as it comes), by the call's place."""

    index: int
    text: str


Part = Said | CallOpened | CallArguments  # what CallParser.feed returns, and a ChatDelta's parts


@dataclass
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    whole: bool = False  # its syntax's reader reached its end


class CallParser:
    """Splits a reply into its text and the calls of `format` as it comes."""

    def __init__(self, format: ToolFormat):
        self.format, self.syntax = format, SYNTAXES[format.syntax]
        self.marker = "" if format.name == GENERIC else format.opening.strip()
        self.state = "generic" if format.name == GENERIC else "start"  # then text, calls, reply or plain
        self.held = ""  # text not said yet: what may still become the marker, or whitespace before it
        self.raw = ""  # the text from the marker on, said as text where it holds no call
        self.calls: list[_Call] = []
        self.reader = None  # the syntax's reader of the call being read
        self.reply: StringReader | None = None  # the generic format's {"response": "..."}
        self.ended = False  # the calls are closed (syntax.ends)

    def feed(self, text: str) -> list[Part]:
        parts: list[Part] = []
        if self.state in ("calls", "reply"):
            self.raw += text
            self._scan(text, parts)
        elif self.state == "plain":
            parts.append(Said("text", text))
        else:
            self.held += text
            self._opening(parts)
        return [p for p in parts if not isinstance(p, Said) or p.text]

    def finish(self) -> list[Part]:
        """What is still held, once the reply has ended."""
        parts = [Said("text", self.held)] if self.state not in ("calls", "reply") else []
        if self.state == "calls" and not self.calls:  # a marker that opened no call: it was text
            parts.append(Said("text", self.raw))
        self.held = ""
        return [p for p in parts if p.text]

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The whole calls: a call cut by the end of the reply (`cut_call`) is not one."""
        return [ToolCall(c.id, c.name, "".join(c.arguments)) for c in self.calls if c.whole]

    @property
    def cut_call(self) -> ToolCall | None:
        """The call the reply ended inside (max_new_tokens or a stop string came first), as far as it came."""
        last = self.calls[-1] if self.calls else None
        return None if last is None or last.whole else ToolCall(last.id, last.name, "".join(last.arguments))

    def _opening(self, parts: list[Part]) -> None:
        """Text state: say what cannot be the marker's start; at the marker, go on to the calls."""
        if self.state == "generic":
            return self._generic_opening(parts)
        if self.format.leading:  # a reply is calls where it starts as them
            starts = self._starts_calls(self.held.lstrip())
            if starts is None:
                return None
            if starts:
                self._to_calls(self.held.lstrip(), parts)
            else:
                self.state = "plain"
                parts.append(Said("text", self.held))
                self.held = ""
            return None
        at = self.held.find(self.marker)
        if at >= 0:
            parts.append(Said("text", self.held[:at].rstrip()))
            self.raw = self.held[at:]
            return self._to_calls(self.held[at + len(self.marker) :], parts, raw=False)
        keep = len(self.held) - partial_suffix(self.held, self.marker)
        while keep > 0 and self.held[keep - 1].isspace():
            keep -= 1
        parts.append(Said("text", self.held[:keep]))
        self.held = self.held[keep:]
        return None

    def _generic_opening(self, parts: list[Part]) -> None:
        """The generic format: {"tool_calls": [...]} is calls, {"response": "..."} a reply."""
        calls, reply = _GENERIC_CALLS.match(self.held), _GENERIC_REPLY.match(self.held)
        if calls:
            self._to_calls(self.held[calls.end() :], parts)
        elif reply:
            self.state, self.reply, self.raw = "reply", StringReader(), self.held
            self._scan(self.held[reply.end() :], parts)
            self.held = ""
        elif not any(_could_become(self.held, target) for target in ('{"tool_calls":', '{"response":"')):
            self.state = "plain"
            parts.append(Said("text", self.held))
            self.held = ""

    def _to_calls(self, rest: str, parts: list[Part], raw: bool = True) -> None:
        if raw:
            self.raw = self.held
        self.state, self.held = "calls", ""
        self._scan(rest, parts)

    def _scan(self, text: str, parts: list[Part]) -> None:
        if self.state == "reply":
            said = "".join(self.reply.feed(c) for c in text if not self.reply.done)
            parts.append(Said("text", said))
            return
        for c in text:
            if self.ended:
                return
            if self.reader is None:  # between calls: the format's markers, separators, brackets, or a call's start
                self.reader = self.syntax.begin(c, self.format.arguments_key)
                self.ended = self.reader is None and bool(self.calls) and self.syntax.ends(c)
                continue
            for event in self.reader.feed(c):
                self._said(event, parts)
            if self.reader.done and self.calls:
                self.calls[-1].whole = True
            if self.reader.done or self.reader.broken:
                self.reader = None

    def _starts_calls(self, text: str) -> bool | None:
        """Whether a reply of a leading format that starts with `text` is calls (None: not known yet)."""
        if not text:
            return None
        if self.format.opening.strip():  # a bare list
            return text.startswith("[")
        return self.syntax.starts(text)

    def _said(self, event: tuple, parts: list[Part]) -> None:
        if event[0] == "name":
            call = _Call(f"call_{os.urandom(12).hex()}", event[1])
            self.calls.append(call)
            parts.append(CallOpened(len(self.calls) - 1, call.id, call.name))
        else:
            self.calls[-1].arguments.append(event[1])
            parts.append(CallArguments(len(self.calls) - 1, event[1]))


_GENERIC_CALLS = re.compile(r'\s*\{\s*"tool_calls"\s*:')
_GENERIC_REPLY = re.compile(r'\s*\{\s*"response"\s*:\s*"')


def _could_become(text: str, target: str) -> bool:
    squeezed = re.sub(r"\s+", "", text)
    return target.startswith(squeezed) or squeezed.startswith(target)


def parse_calls(text: str, format: ToolFormat) -> tuple[str, list[ToolCall]]:
    """(the reply's text, the calls) of a whole reply; text that holds no call stays text."""
    parser = CallParser(format)
    parts = [*parser.feed(text), *parser.finish()]
    return "".join(p.text for p in parts if isinstance(p, Said)), parser.tool_calls
