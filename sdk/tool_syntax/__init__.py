"""The syntaxes a model writes its tool calls in: each a plug-in of one file, and SYNTAXES the table
of them, in the order tools.py's probe tries them. A syntax declares:

- `probe(text, after, name, arguments)`: where a rendered template wrote the probe call (`name`
  with `arguments`, strings) after `after`, and the key its arguments are under: (start, end, key);
- `rules(request, arguments_key)`: the Lark rules of `call`, one call of the offered tools, each
  valid for its tool's schema;
- `begin(c, arguments_key)`: the reader of the call `c` opens, between calls (None: `c` opens
  none); a reader's `feed(c)` gives ("name", name) once the name is whole, then ("arguments",
  JSON text) as they come, and it is `done` at the call's end or `broken` where it is no call;
- `ends(c)`: whether `c`, between calls, closes the turn's calls;
- `starts(text)`: whether a reply that starts with `text` is calls, where calls open a turn bare
  (None: not known yet), and `text_first`, the characters free text starts with there;
- `lists`: whether the calls may be written as one JSON array.

A new syntax is a module that declares one, and an entry here."""

from __future__ import annotations

from .json_calls import JSON_CALLS
from .pythonic import PYTHONIC_CALLS

SYNTAXES = {syntax.name: syntax for syntax in (JSON_CALLS, PYTHONIC_CALLS)}
