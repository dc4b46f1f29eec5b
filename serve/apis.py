"""The table of the APIs the server speaks, by path (api.py says what each declares). From it come
the generation routes app.py makes, the request bodies /openapi.json describes (and so the
metrics' path labels, read off the routes), and the error shape and field names of each path.
A new API is a module that declares its Api, and one entry here."""

from __future__ import annotations

from .anthropic import MESSAGES
from .api import Api
from .openai import CHAT, COMPLETIONS, EMBEDDINGS
from .responses import RESPONSES

APIS: dict[str, Api] = {api.path: api for api in (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, MESSAGES)}


def api_of(path: str) -> Api | None:
    """The API a path belongs to: its own path, or one under it (/v1/messages/count_tokens is the
    Messages API's, /v1/responses/{id} the Responses API's)."""
    return next((api for api in APIS.values() if path == api.path or path.startswith(api.path + "/")), None)
