"""The JSON schema of one tool call (its name and its arguments), which every syntax's grammar
holds each call to, and the rebasing of references that lets a tool's schema be nested in
another."""

from __future__ import annotations

import urllib.parse


def call_schema(request, arguments_key: str = "arguments") -> dict:
    """The JSON schema of one call of the offered tools (`request`, a tools.ToolRequest): its name
    and its arguments under `arguments_key`. The arguments hold the declared properties only,
    unless the schema allows others (`additionalProperties`): a model left free to add keys may
    never end its call. A tool whose parameters refer within themselves (`$ref`, as pydantic
    writes `$defs`) is kept whole under the root's `$defs` and its references rebased there; a
    schema that nests this one lifts those `$defs` to its own root (`lifted`)."""
    variants, definitions = [], {}
    for i, tool in enumerate(request.offered()):
        arguments = _declared(tool["function"]["parameters"])
        if refers(arguments):
            definitions[f"edgeinfer_tool_{i}"] = rebased(arguments, f"#/$defs/edgeinfer_tool_{i}")
            arguments = {"$ref": f"#/$defs/edgeinfer_tool_{i}"}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool["function"]["name"]}, arguments_key: arguments},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return {**schema, "$defs": definitions} if definitions else schema


def _declared(parameters: dict) -> dict:
    if parameters.get("type") == "object" and "properties" in parameters and "additionalProperties" not in parameters:
        return {**parameters, "additionalProperties": False}
    return parameters


def refers(schema) -> bool:
    """Whether `schema` holds a `$ref` within itself ("#..."), which breaks once it is nested."""
    return next(_local_refs(schema), None) is not None


def dangling_ref(schema) -> str | None:
    """The first reference within `schema` ("#/$defs/Loc") that names nothing in it, or None."""
    return next((ref for ref in _local_refs(schema) if not _resolves(schema, ref[1:])), None)


def _local_refs(schema):
    """Each reference within `schema` ("#", "#/$defs/Loc"), depth first."""
    if isinstance(schema, dict):
        if isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#"):
            yield schema["$ref"]
        for value in schema.values():
            yield from _local_refs(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from _local_refs(value)


def _resolves(schema, pointer: str) -> bool:
    """Whether the JSON pointer ("/$defs/Loc", "" for the root) names something in `schema`."""
    node = schema
    for token in pointer.split("/")[1:] if pointer else []:
        token = urllib.parse.unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return False
    return True


def rebased(schema, root: str):
    """`schema` with each reference within it ("#/$defs/Loc", "#") rebased onto `root`, where it now lives."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        moved = {k: rebased(v, root) for k, v in schema.items() if k != "$ref"}
        if isinstance(ref, str) and ref.startswith("#"):
            moved["$ref"] = root + ref[1:]
        elif ref is not None:
            moved["$ref"] = ref
        return moved
    if isinstance(schema, list):
        return [rebased(v, root) for v in schema]
    return schema


def lifted(outer: dict, inner: dict) -> dict:
    """`outer`, a schema that nests `inner`, with `inner`'s `$defs` (call_schema's) at its root."""
    return {**outer, "$defs": inner["$defs"]} if "$defs" in inner else outer
