"""Tool calls: the tools rendered into the prompt, the call format read off the model's own chat
template, and decoding constrained to a valid call where one is required (and, with "auto", once
the model opens one). The calls are read back out of the output by tool_parser.py.

The format is found by rendering the template with a known call and reading what it writes
around it (Hermes/Qwen's `<tool_call>...</tool_call>`, Llama 3's bare JSON with "parameters",
Mistral's `[TOOL_CALLS][...]`, or any other markers around a JSON object or array). A template
that renders no tools gets the generic format: the tools described in a system message, and the
answer a JSON object, `{"tool_calls": [...]}` or `{"response": "..."}`, always constrained, so
even a model never trained on tools answers in a shape that parses.
"""

from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass

from .constraints import JSON_DEFAULTS
from .errors import SettingsError
from .tool_syntax import SYNTAXES
from .tool_syntax.schema import call_schema, dangling_ref, lifted

GENERIC = "generic"
_PROBE_NAME, _PROBE_ARGUMENTS = "edgeinfer_probe", {"edgeinfer_argument": "edgeinfer_value"}
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _PROBE_NAME,
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {"edgeinfer_argument": {"type": "string"}}},
    },
}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: `arguments` is the JSON text of the arguments, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes its calls: `opening` text, the calls (each in `syntax`, a name of
    tool_syntax.SYNTAXES; JSON calls may be one JSON array where `is_list`), `between` two calls,
    `closing` text; each call's arguments under `arguments_key`. `name` is GENERIC, or "template"
    for a format read off the template."""

    name: str
    opening: str = ""
    closing: str = ""
    between: str | None = None  # None: the template writes one call per turn
    arguments_key: str = "arguments"
    is_list: bool = False
    syntax: str = "json"

    @property
    def leading(self) -> bool:
        """Calls come only at the start of a turn: their opening is empty or a bare `[`, which text
        may hold anywhere."""
        return self.opening.strip() in ("", "[")


@dataclass(frozen=True)
class ToolRequest:
    """A chat call's tools, checked: `tools` in OpenAI's shape, `choice` "auto", "none",
    "required" or a tool's name, and whether several calls may come in one turn."""

    tools: tuple[dict, ...]
    choice: str
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice not in ("auto", "none")

    def offered(self) -> list[dict]:
        """The tools the output may call."""
        if self.choice in ("auto", "none", "required"):
            return list(self.tools)
        return [t for t in self.tools if t["function"]["name"] == self.choice]


def tool_request(tools, tool_choice=None, parallel_tool_calls: bool = False) -> ToolRequest:
    """`tools` (a list of {"type": "function", "function": {"name", "description", "parameters"}})
    and `tool_choice` ("auto", "none", "required", or {"type": "function", "function": {"name": ...}})
    checked, or a SettingsError naming the one at fault."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise SettingsError('tools must be a non-empty list of {"type": "function", "function": {...}} objects', "tools")
    checked = tuple(_checked_tool(tool, index) for index, tool in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise SettingsError(f"tools must have distinct names, got {names}", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise SettingsError(
                f"tool_choice {json.dumps(choice)} names no tool of tools ({', '.join(names)}): "
                'pass {"type": "function", "function": {"name": NAME}} with one of them',
                "tool_choice",
            )
        choice = name
    elif choice not in ("auto", "none", "required"):
        raise SettingsError(f"tool_choice must be 'auto', 'none', 'required' or a named function, got {choice!r}", "tool_choice")
    if not isinstance(parallel_tool_calls, bool):
        raise SettingsError(f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r}", "parallel_tool_calls")
    return ToolRequest(checked, choice, parallel_tool_calls)


def _checked_tool(tool, index: int) -> dict:
    where = f"tools[{index}]"
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict):
        raise SettingsError(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}', where)
    name, parameters = function.get("name"), function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_-" for c in name) or len(name) > 64:
        raise SettingsError(f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}", f"{where}.function.name")
    if not isinstance(parameters, dict):
        raise SettingsError(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
    if (ref := dangling_ref(parameters)) is not None:
        raise SettingsError(
            f"{where}.function.parameters refers to {ref!r}, which is not in the schema: define it (under $defs) or inline it",
            f"{where}.function.parameters",
        )
    return {"type": "function", "function": {**function, "parameters": parameters}}


_FORMATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {template: ToolFormat}


def tool_format(tokenizer) -> ToolFormat:
    """The format the model's chat template writes calls in, found once per template by rendering
    a known call."""
    known = _FORMATS.setdefault(tokenizer, {})
    template = tokenizer.chat_template or ""
    if template not in known:
        known[template] = _read_format(tokenizer, template)
    return known[template]


def _read_format(tokenizer, template: str) -> ToolFormat:
    if "tool" not in template:
        return ToolFormat(GENERIC)
    user = {"role": "user", "content": "Hello"}
    try:
        prompt = tokenizer.render_chat([user], True, tools=[_PROBE_TOOL])
        one = tokenizer.render_chat([user, _probe_turn(1)], False, tools=[_PROBE_TOOL])
    except Exception:  # noqa: BLE001 - a template may raise anything on a turn it does not expect: then it has no usable format
        return ToolFormat(GENERIC)
    prompt = _without_thought(prompt)
    turn = one[len(os.path.commonprefix([prompt, one])) :]
    found = _probe_call(turn)
    if found is None:
        return ToolFormat(GENERIC)
    start, end, key, syntax = found
    ends = [tokenizer.spec.eos_token, *(t for t in tokenizer.special_tokens if t not in turn[:start])]
    opening, closing = turn[:start], _turn_end(turn[end:], ends)
    is_list = SYNTAXES[syntax].lists and opening.endswith("[") and closing.startswith("]")
    if is_list:
        opening, closing = opening[:-1], closing[1:]
    between = _between(tokenizer, user, prompt, is_list)
    return ToolFormat("template", opening.lstrip(" "), closing, between, key, is_list, syntax)


def _without_thought(prompt: str) -> str:
    """A generation prompt without the thought it opens (`<think>`), which a turn with calls does
    not start with: the call's opening is what follows the prompt's own part."""
    from .reasoning import MARKERS

    stripped = prompt.rstrip()
    for opening, _ in MARKERS:
        if stripped.endswith(opening):
            return stripped[: -len(opening)]
    return prompt


def _probe_turn(count: int) -> dict:
    call = {"type": "function", "id": "call_0", "function": {"name": _PROBE_NAME, "arguments": _PROBE_ARGUMENTS}}
    return {"role": "assistant", "content": "", "tool_calls": [call] * count}


def _probe_call(text: str, after: int = 0) -> tuple[int, int, str, str] | None:
    """(start, end, arguments key, syntax) of the probe call in `text` after `after`, in the first
    syntax of SYNTAXES that finds it."""
    for name, syntax in SYNTAXES.items():
        found = syntax.probe(text, after, _PROBE_NAME, _PROBE_ARGUMENTS)
        if found is not None:
            return (*found, name)
    return None


def _turn_end(text: str, ends: list[str]) -> str:
    """What follows a call up to the end of the assistant's turn: the first of `ends` (the EOS,
    and the special tokens a template closes a turn with, such as <|im_end|> where the EOS is
    <|endoftext|>: a model's end ids take them, and generation ends there)."""
    found = [text.index(end) for end in ends if end and end in text]
    return text[: min(found)] if found else text.rstrip()


def _between(tokenizer, user: dict, prompt: str, is_list: bool) -> str | None:
    """What the template writes between two calls of one turn; None where it writes one only."""
    try:
        two = tokenizer.render_chat([user, _probe_turn(2)], False, tools=[_PROBE_TOOL])
    except Exception:  # noqa: BLE001 - see tool_format
        return None
    first = _probe_call(two, len(os.path.commonprefix([prompt, two])))
    second = None if first is None else _probe_call(two, first[1])
    if second is None or is_list:  # a list's calls are one JSON array, whatever is between them
        return None
    return two[first[1] : second[0]]


def generic_schema(request: ToolRequest) -> dict:
    """The generic format's answer: the calls, or (where the choice allows a reply) a reply."""
    one = call_schema(request)
    calls = {"type": "array", "items": {k: v for k, v in one.items() if k != "$defs"}, "minItems": 1}
    if not request.parallel:
        calls["maxItems"] = 1
    call = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"], "additionalProperties": False}
    if request.forced:
        return lifted(call, one)
    reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"], "additionalProperties": False}
    return lifted({"anyOf": [call, reply]}, one)


def call_grammar(request: ToolRequest, format: ToolFormat, special: dict[str, int]) -> str:
    """An llguidance Lark grammar that admits only the format's calls of the offered tools, each
    valid for its tool's schema (one, or one or more with `parallel`). `special`: the special
    tokens' texts and ids, which the grammar names by id."""
    if format.is_list:
        one = call_schema(request, format.arguments_key)
        items = {k: v for k, v in one.items() if k != "$defs"}
        compact = {"x-guidance": JSON_DEFAULTS}  # JSON as json.dumps writes it, as for response_format
        array = {"type": "array", "items": items, "minItems": 1, **({} if request.parallel else {"maxItems": 1}), **compact}
        body = f"%json {json.dumps(lifted(array, one))}"
    elif request.parallel and format.between is not None:
        body = f"call ({_literal(format.between, special)} call)*"
    else:
        body = "call"
    rules = [
        "start: " + " ".join(part for part in (_literal(format.opening, special), body, _literal(format.closing, special)) if part)
    ]
    if not format.is_list:
        rules += SYNTAXES[format.syntax].rules(request, format.arguments_key)
    return "\n".join(rules)


def auto_grammar(request: ToolRequest, format: ToolFormat, special: dict[str, int]) -> str:
    """The grammar of a turn that may call (tool_choice "auto"): free text, or text up to the
    format's opening and then only valid calls, so that a call the model opens ends valid. An
    opening that is a special token is matched as that token (free text is then any other token)."""
    forced = call_grammar(request, format, special).split("\n", 1)
    start, rules = forced[0].removeprefix("start: "), forced[1:]
    opening = _literal(format.opening, special)
    body = start.removeprefix(opening).strip() if opening else start
    if format.leading:  # a bare call (or a bare list): text is anything that does not start as one
        first = r"[^\[]" if format.opening.strip() else SYNTAXES[format.syntax].text_first
        return "\n".join([f"start: TEXT | {start}", f"TEXT: /{first}(.|\n)*/", *rules])
    trigger = min(((format.opening.find(t), t) for t in special if t and t in format.opening), default=None)
    if trigger is not None:  # the call opens with a special token: text is every other token
        at, token = trigger
        rest = _literal(format.opening[at:], special)
        return "\n".join([f"start: free | free {rest} {body}", f"free: <[^{special[token]}]>*", *rules])
    stop = json.dumps(format.opening)
    return "\n".join(["start: plain | text " + body, 'plain[stop=""]: /(.|\n)*/', f"text[stop={stop}]: /(.|\n)*/", *rules])


def thought_first(response_format: dict, thinking) -> dict:
    """A tool plan's constraint with a reasoning model's thought before it (`thinking`, a
    ReasoningFormat): where the prompt opened the thought, the output starts inside it; else it
    may open one. The thought ends at its closing marker (or where its budget forces it); the call
    is constrained from there."""
    if response_format["type"] == "grammar":
        start, _, rules = response_format["lark"].partition("\n")
        body = start.removeprefix("start: ")
    else:  # the generic format's JSON schema
        schema = {**response_format["json_schema"]["schema"], "x-guidance": JSON_DEFAULTS}
        body, rules = f"%json {json.dumps(schema)}", ""
    thought = "thought" if thinking.opened_by_prompt else f"({json.dumps(thinking.opening)} thought)?"
    # the stop string ends the thought and stays in the output, as the auto grammar's opening does
    lark = "\n".join([f"start: {thought} ({body})", f"thought[stop={json.dumps(thinking.closing)}]: /(.|\\n)*/", rules])
    return {"type": "grammar", "lark": lark.rstrip("\n")}


def _literal(text: str, special: dict[str, int]) -> str:
    """`text` as a sequence of Lark string literals, its special tokens as `<[id]>`."""
    parts, rest = [], text
    while rest:
        found = min(((rest.find(t), t) for t in special if t and t in rest), default=None)
        if found is None:
            parts.append(json.dumps(rest))
            break
        at, token = found
        if at:
            parts.append(json.dumps(rest[:at]))
        parts.append(f"<[{special[token]}]>")
        rest = rest[at + len(token) :]
    return " ".join(parts)


def generic_messages(messages: list[dict], request: ToolRequest) -> list[dict]:
    """The conversation for a template that renders no tools: the tools described in the system
    message; earlier calls and their results written as the generic format's text."""
    described = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in request.offered())
    shape = '{"tool_calls": [{"name": NAME, "arguments": {...}}]}'
    reply = "" if request.forced else ', or {"response": "your reply"} to answer without a tool'
    system = f"You can call these tools:\n{described}\nAnswer with one JSON object: {shape} to call tools{reply}."
    converted = [_generic_message(m) for m in messages]
    if converted and converted[0]["role"] == "system":
        return [{"role": "system", "content": converted[0]["content"] + "\n\n" + system}, *converted[1:]]
    return [{"role": "system", "content": system}, *converted]


def _generic_message(message: dict) -> dict:
    if message.get("tool_calls"):
        calls = [
            {"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))} for c in message["tool_calls"]
        ]
        return {"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)}
    if message["role"] == "tool":
        return {"role": "user", "content": f"Result of tool call {message.get('tool_call_id', '')}: {message['content']}"}
    return message


def _arguments(value):
    """A call's arguments as the templates expect them, a dict, whether given as JSON text or not."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


@dataclass(frozen=True)
class ToolPlan:
    """What a chat call with tools renders and constrains: the `messages` and `tools` for the
    template, the `response_format` that constrains the output (None: free), the `format`."""

    messages: list[dict]
    tools: list[dict] | None
    response_format: dict | None
    format: ToolFormat


def plan(tokenizer, messages: list[dict], request: ToolRequest) -> ToolPlan:
    format = tool_format(tokenizer)
    if format.name == GENERIC:
        if request.choice == "none":
            return ToolPlan([_generic_message(m) for m in messages], None, None, format)
        schema = {"type": "json_schema", "json_schema": {"schema": generic_schema(request)}}
        return ToolPlan(generic_messages(messages, request), None, schema, format)
    if request.choice == "none":
        return ToolPlan(messages, None, None, format)
    grammar = (call_grammar if request.forced else auto_grammar)(request, format, tokenizer.special_tokens)
    return ToolPlan(messages, list(request.tools), {"type": "grammar", "lark": grammar}, format)
