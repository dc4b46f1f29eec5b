"""Calls written as Python, `name(key=value, ...)` with JSON values, in a list (Llama 3.2 and 4's,
Gemma's tool_code, vLLM's "pythonic" parser): the probe that finds one in a rendered template, the
grammar of one call (each argument valid for its property's schema), and the reader that takes one
a character at a time and gives its arguments as JSON text."""

from __future__ import annotations

import json
import re

from ..constraints import JSON_DEFAULTS
from .json_calls import track
from .schema import rebased, refers

NAME_CHAR = re.compile(r"[A-Za-z0-9_.-]")
_START = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


class PythonicCalls:
    """The syntax of pythonic calls (tool_syntax's contract)."""

    name = "pythonic"
    lists = False  # the list's brackets are the format's opening and closing
    text_first = r"[^\[]"

    def probe(self, text: str, after: int, name: str, arguments: dict) -> tuple[int, int, str] | None:
        """(start, end, "arguments") of the call of `name` with `arguments` (strings) after `after`."""
        written = r"\s*,\s*".join(rf"{re.escape(k)}\s*=\s*{re.escape(json.dumps(v))}" for k, v in arguments.items())
        found = re.compile(rf"{re.escape(name)}\(\s*{written}\s*\)").search(text, after)
        return None if found is None else (found.start(), found.end(), "arguments")

    def rules(self, request, arguments_key: str) -> list[str]:
        return _rules(request)

    def begin(self, c: str, arguments_key: str) -> PythonicReader | None:
        """The reader of a call whose name starts with `c`, `c` read; None where `c` starts none."""
        if not NAME_CHAR.match(c):
            return None
        reader = PythonicReader()
        reader.feed(c)
        return reader

    def ends(self, c: str) -> bool:
        """`]` between calls closes the list: what follows is the format's closing."""
        return c == "]"

    def starts(self, text: str) -> bool | None:
        name = _START.match(text)
        if name is None:
            return False
        return None if name.end() == len(text) else text[name.end()] == "("


def _rules(request) -> list[str]:
    """The rules of a pythonic call, `name(key=value, ...)`: the required arguments in the schema's
    order, then any of the others in order, each value JSON valid for its property's schema."""
    tools = request.offered()
    rules = ["call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        name, parameters = tool["function"]["name"], tool["function"]["parameters"]
        properties = parameters.get("properties") or {}
        required = [k for k in properties if k in set(parameters.get("required") or [])]
        optional = [k for k in properties if k not in required]
        value = lambda key: f"{json.dumps(key + '=')} %json {json.dumps(_argument_schema(parameters, key))}"  # noqa: E731
        head = ' ", " '.join(value(k) for k in required)
        rules.append(f'call_{i}: {json.dumps(name + "(")} {f"{head} " if head else ""}rest_{i}_0 ")"')
        for at in range(len(optional) + 1):  # rest_i_at: any of the optional arguments from `at` on, in order
            comma = '", " ' if head or at else ""
            later = [f"{comma}{value(optional[j])} rest_{i}_{j + 1}" for j in range(at, len(optional))]
            rules.append(f"rest_{i}_{at}: " + " | ".join(['""', *later]))
    return rules


def _argument_schema(parameters: dict, key: str) -> dict:
    """The schema of one argument of a pythonic call, standing alone: references within the
    tool's parameters are rebased onto a copy of them under its `$defs`."""
    schema = {**parameters["properties"][key], "x-guidance": JSON_DEFAULTS}
    if not refers(parameters):
        return schema
    return {**rebased(schema, "#/$defs/parameters"), "$defs": {"parameters": rebased(parameters, "#/$defs/parameters")}}


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
            elif NAME_CHAR.match(c):
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
        elif NAME_CHAR.match(c):
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
            track(self, c)
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


PYTHONIC_CALLS = PythonicCalls()
