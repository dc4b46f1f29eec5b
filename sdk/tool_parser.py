"""Tool calls read out of a reply as it is generated: the text before a call is said as it comes,
each call's name once it is whole, and its arguments piece by piece, as OpenAI's and Anthropic's
streams send them. A whole reply is read the same way, so a stream's pieces join to the whole.

The reader holds back only what may still be the start of the format's opening marker (and the
whitespace before it); from the marker on, the calls are JSON objects, read a character at a time
(CallReader). Text from a marker on that holds no call is said as text when the reply ends.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from .reasoning import partial_suffix
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


class CallParser:
    """Splits a reply into its text and the calls of `format` as it comes."""

    def __init__(self, format: ToolFormat):
        self.format = format
        self.marker = "" if format.name == GENERIC else format.opening.strip()
        self.state = "generic" if format.name == GENERIC else "start"  # then text, calls, reply or plain
        self.held = ""  # text not said yet: what may still become the marker, or whitespace before it
        self.raw = ""  # the text from the marker on, said as text where it holds no call
        self.calls: list[_Call] = []
        self.reader: CallReader | None = None
        self.reply: StringReader | None = None  # the generic format's {"response": "..."}
        self.ended = False  # a pythonic list closed

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
        return [ToolCall(c.id, c.name, "".join(c.arguments)) for c in self.calls]

    def _opening(self, parts: list[Part]) -> None:
        """Text state: say what cannot be the marker's start; at the marker, go on to the calls."""
        if self.state == "generic":
            return self._generic_opening(parts)
        if self.format.leading:  # a reply is calls where it starts as them
            starts = _starts_calls(self.held.lstrip(), self.format)
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
            if self.reader is None:
                if c == "{" and not self.format.pythonic:
                    self.reader = CallReader(self.format.arguments_key)  # it reads from after the brace
                    continue
                if self.format.pythonic and _NAME_CHAR.match(c):
                    self.reader = PythonicReader()
                elif self.format.pythonic and c == "]" and self.calls:
                    self.ended = True  # the list of calls is closed: what follows is the format's closing
                if self.reader is None:
                    continue  # between calls: the format's markers, separators, brackets
            for event in self.reader.feed(c):
                self._said(event, parts)
            if self.reader.done or self.reader.broken:
                self.reader = None

    def _said(self, event: tuple, parts: list[Part]) -> None:
        if event[0] == "name":
            call = _Call(f"call_{os.urandom(12).hex()}", event[1])
            self.calls.append(call)
            parts.append(CallOpened(len(self.calls) - 1, call.id, call.name))
        else:
            self.calls[-1].arguments.append(event[1])
            parts.append(CallArguments(len(self.calls) - 1, event[1]))


_NAME_CHAR = re.compile(r"[A-Za-z0-9_.-]")
_PYTHONIC_START = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def _starts_calls(text: str, format: ToolFormat) -> bool | None:
    """Whether a reply of a leading format that starts with `text` is calls (None: not known yet)."""
    if not text:
        return None
    if format.opening.strip():  # a bare list
        return text.startswith("[")
    if not format.pythonic:
        return text[0] in "{["
    name = _PYTHONIC_START.match(text)
    if name is None:
        return False
    return None if name.end() == len(text) else text[name.end()] == "("


_GENERIC_CALLS = re.compile(r'\s*\{\s*"tool_calls"\s*:')
_GENERIC_REPLY = re.compile(r'\s*\{\s*"response"\s*:\s*"')


def _could_become(text: str, target: str) -> bool:
    squeezed = re.sub(r"\s+", "", text)
    return target.startswith(squeezed) or squeezed.startswith(target)


class StringReader:
    """A JSON string's characters decoded as they come, after its opening quote; `done` at its end."""

    def __init__(self):
        self.escape, self.high, self.done = "", "", False

    def feed(self, c: str) -> str:
        if self.escape:
            self.escape += c
            if len(self.escape) < (6 if self.escape[1] == "u" else 2):
                return ""
            decoded, self.escape = json.loads(f'"{self.escape}"'), ""
            if "\ud800" <= decoded <= "\udbff":  # the first half of a surrogate pair: wait for the second
                self.high = decoded
                return ""
            if self.high:
                decoded, self.high = (self.high + decoded).encode("utf-16", "surrogatepass").decode("utf-16"), ""
            return decoded
        if c == "\\":
            self.escape = c
            return ""
        if c == '"':
            self.done = True
            return ""
        return c


class CallReader:
    """One call's JSON object, read a character at a time after its `{`: ("name", name) once the
    name is whole, ("arguments", text) as the arguments come (held until the name is known); a
    call without arguments gets {}. `broken` where the object is no call."""

    def __init__(self, arguments_key: str):
        self.arguments_key = arguments_key
        self.state = "key"  # key, in_key, colon, value, in_value, after_value
        self.key = self.kind = None
        self.string: StringReader | None = None
        self.depth, self.in_string, self.escaped = 0, False, False
        self.name: str | None = None
        self.name_text, self.held_arguments, self.has_arguments = "", "", False
        self.done = self.broken = False

    def feed(self, c: str) -> list[tuple]:
        events: list[tuple] = []
        if self.state == "in_value":
            self._value(c, events)
            return events
        if c.isspace() and self.state != "in_key":
            return events
        if self.state == "key":
            self._key_or_end(c, events)
        elif self.state == "in_key":
            self.string.feed(c)
            if self.string.done:
                self.state = "colon"
        elif self.state == "colon":
            self.state, self.broken = ("value", False) if c == ":" else (self.state, True)
        elif self.state == "value":
            self._value_start(c, events)
        elif c == ",":  # after_value
            self.state = "key"
        elif c == "}":
            self._end(events)
        else:
            self.broken = True
        return events

    def _key_or_end(self, c: str, events: list) -> None:
        if c == '"':
            self.state, self.string, self.key = "in_key", _KeyReader(), None
        elif c == "}":
            self._end(events)
        else:
            self.broken = True

    def _value_start(self, c: str, events: list) -> None:
        self.key = self.string.text
        self.state = "in_value"
        if c == '"':
            self.kind, self.string = "string", StringReader()
        elif c in "{[":
            self.kind, self.depth, self.in_string, self.escaped = "compound", 1, False, False
            self._take(c, events)
        else:
            self.kind = "scalar"
            self._take(c, events)

    def _value(self, c: str, events: list) -> None:
        if self.kind == "string":
            self._take(self.string.feed(c), events)
            if self.string.done:
                self._value_done(events)
        elif self.kind == "compound":
            self._take(c, events)
            _track(self, c)
            if self.depth == 0:
                self._value_done(events)
        elif c in ",}" or c.isspace():
            self._value_done(events)
            self.feed(c)  # the character ends the scalar and is the object's own
        else:
            self._take(c, events)

    def _take(self, text: str, events: list) -> None:
        """A piece of the current value."""
        if not text:
            return
        if self.key == "name":
            self.name_text += text
        elif self.key == self.arguments_key:
            self.has_arguments = True
            if self.name is None:
                self.held_arguments += text
            else:
                events.append(("arguments", text))

    def _value_done(self, events: list) -> None:
        self.state = "after_value"
        if self.key == "name" and self.name is None:
            if self.kind != "string":
                self.broken = True
                return
            self.name = self.name_text
            events.append(("name", self.name))
            if self.held_arguments:
                events.append(("arguments", self.held_arguments))

    def _end(self, events: list) -> None:
        if self.name is None:
            self.broken = True
            return
        if not self.has_arguments:
            events.append(("arguments", "{}"))
        self.done = True


class PythonicReader:
    """One pythonic call, `name(key=value, ...)`, read a character at a time from its name's first
    character: ("name", name) at its "(", then its arguments as JSON text as they come (values
    are JSON; Python's True, False and None and single-quoted strings are turned into JSON)."""

    def __init__(self):
        self.state, self.name, self.key, self.value, self.count = "name", "", "", "", 0
        self.depth, self.in_string, self.escaped, self.quote = 0, False, False, ""
        self.done = self.broken = False

    def feed(self, c: str) -> list[tuple]:
        events: list[tuple] = []
        if self.state == "name":
            if c == "(":
                self.state = "key"
                events += [("name", self.name), ("arguments", "{")]
            elif _NAME_CHAR.match(c):
                self.name += c
            else:
                self.broken = True
        elif self.state == "in_value":
            self._value(c, events)
        elif self.state in ("key", "in_key"):
            self._key(c, events)
        elif self.state == "value" and not c.isspace():
            self.state, self.value = "in_value", ""
            self.quote = c if c in "\"'" else ""
            self.depth, self.in_string, self.escaped = (1 if c in "{[" else 0), False, False
            if c in "{[" or c == '"':
                events.append(("arguments", c))
                self.in_string = c == '"'
            elif c != "'":
                self.value = c
        elif self.state == "after_value" and not c.isspace():
            self._after(c, events)
        return events

    def _key(self, c: str, events: list) -> None:
        if c == "=" and self.key:
            events.append(("arguments", (", " if self.count else "") + json.dumps(self.key) + ": "))
            self.state, self.count = "value", self.count + 1
        elif c == ")" and self.state == "key" and not self.key:
            events.append(("arguments", "}"))
            self.done = True
        elif _NAME_CHAR.match(c):
            self.key, self.state = self.key + c, "in_key"
        elif not c.isspace():
            self.broken = True

    def _value(self, c: str, events: list) -> None:
        if self.quote == "'":  # a Python string: sent as JSON once whole
            if self.escaped:
                self.value, self.escaped = self.value + _PYTHON_ESCAPES.get(c, "\\" + c), False
            elif c == "\\":
                self.escaped = True
            elif c == "'":
                events.append(("arguments", json.dumps(self.value, ensure_ascii=False)))
                self.state = "after_value"
            else:
                self.value += c
        elif self.quote == '"' or self.depth:
            events.append(("arguments", c))
            _track(self, c)
            if not self.in_string and not self.depth:
                self.state = "after_value"
        elif c in ",)" or c.isspace():  # a number, or Python's True, False, None
            events.append(("arguments", _PYTHON_LITERALS.get(self.value, self.value)))
            self.state = "after_value"
            if not c.isspace():
                self._after(c, events)
        else:
            self.value += c

    def _after(self, c: str, events: list) -> None:
        if c == ",":
            self.state, self.key = "key", ""
        elif c == ")":
            events.append(("arguments", "}"))
            self.done = True
        else:
            self.broken = True


_PYTHON_ESCAPES = {"n": "\n", "t": "\t", "'": "'", '"': '"', "\\": "\\"}
_PYTHON_LITERALS = {"True": "true", "False": "false", "None": "null"}


def _track(reader, c: str) -> None:
    """Where a JSON value stands after `c`: its nesting `depth`, and whether it is in a string."""
    if reader.in_string:
        if reader.escaped:
            reader.escaped = False
        elif c == "\\":
            reader.escaped = True
        elif c == '"':
            reader.in_string = False
    elif c == '"':
        reader.in_string = True
    elif c in "{[":
        reader.depth += 1
    elif c in "}]":
        reader.depth -= 1


class _KeyReader(StringReader):
    """A key's string, kept whole."""

    def __init__(self):
        super().__init__()
        self.text = ""

    def feed(self, c: str) -> str:
        said = super().feed(c)
        self.text += said
        return said


def parse_calls(text: str, format: ToolFormat) -> tuple[str, list[ToolCall]]:
    """(the reply's text, the calls) of a whole reply; text that holds no call stays text."""
    parser = CallParser(format)
    parts = [*parser.feed(text), *parser.finish()]
    return "".join(p.text for p in parts if isinstance(p, Said)), parser.tool_calls
