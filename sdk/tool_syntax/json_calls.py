"""Calls written as JSON objects, `{"name": ..., "arguments": {...}}` (Hermes/Qwen's, Llama 3's
with "parameters", Mistral's list of them, the generic format's): the probe that finds one in a
rendered template, the grammar rule of one call, and the reader that takes one a character at a
time as it is generated."""

from __future__ import annotations

import json

from ..constraints import JSON_DEFAULTS
from .schema import call_schema


class JsonCalls:
    """The syntax of JSON calls (tool_syntax's contract)."""

    name = "json"
    lists = True  # the calls may be one JSON array
    text_first = r"[^{\[]"  # what free text starts with where a bare call may open the turn

    def probe(self, text: str, after: int, name: str, arguments: dict) -> tuple[int, int, str] | None:
        """(start, end, arguments key) of the first JSON object after `after` that is the call of
        `name` with `arguments` (under any key, as an object or as its JSON text)."""
        return _json_probe(text, after, name, arguments)

    def rules(self, request, arguments_key: str) -> list[str]:
        compact = {"x-guidance": JSON_DEFAULTS}  # JSON as json.dumps writes it, as for response_format
        return [f"call: %json {json.dumps({**call_schema(request, arguments_key), **compact})}"]

    def begin(self, c: str, arguments_key: str) -> CallReader | None:
        """The reader of a call that `c`, between calls, opens (its `{`), or None."""
        return CallReader(arguments_key) if c == "{" else None

    def ends(self, c: str) -> bool:
        return False

    def starts(self, text: str) -> bool | None:
        """Whether a reply that starts with `text` (not empty) is calls, where they may open the turn bare."""
        return text[0] in "{["


def _json_probe(text: str, after: int, name: str, arguments: dict) -> tuple[int, int, str] | None:
    decoder = json.JSONDecoder()
    at = text.find(f'"{name}"', after)
    while at >= 0:
        for start in range(at, after - 1, -1):
            if text[start] != "{":
                continue
            try:
                value, end = decoder.raw_decode(text, start)
            except ValueError:
                continue
            if isinstance(value, dict) and value.get("name") == name:
                key = next((k for k, v in value.items() if v in (arguments, json.dumps(arguments))), None)
                if key is not None:
                    return start, end, key
        at = text.find(f'"{name}"', at + 1)
    return None


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
            track(self, c)
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


def track(reader, c: str) -> None:
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


JSON_CALLS = JsonCalls()
