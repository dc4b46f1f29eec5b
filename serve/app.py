"""The HTTP layer: requests in, the scheduler's pieces out as one response or as server-sent events.
It translates and nothing more: one route (`_Routes.turn`) runs every generation API of the table
(apis.py; each API's module its shapes), the scheduler does the batching, guard.py what every
request passes before it reaches a route, and one handler per error kind answers in the shape of the
API asked."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import threading
from pathlib import Path
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgeinfer import __version__
from edgeinfer.sdk.errors import ContextLengthError, EdgeInferError
from edgeinfer.sdk.chat import ChatTurn, chat_turn, closed_text
from edgeinfer.sdk.chat_stream import ChatStream
from edgeinfer.sdk.prepare import budget
from edgeinfer.sdk.sequence import GenerationResult, Piece
from edgeinfer.sdk.tokenizer import template_variables

from . import anthropic, llama, openai, responses, ui_vendor
from . import backend as backends
from .api import Api, Event, Reply, Served
from .apis import APIS, api_of
from .backend import Backend
from .checks import RequestError, check_room, error_body, fingerprint, from_edgeinfer
from .guard import Guard, answer, refusal
from .image_urls import ImageFetcher, refuse_urls
from .metrics import CONTENT_TYPE, Metrics
from .models import ModelSet, adapter_entries, folder_of, held_bytes, model_fields, with_adapter

log = logging.getLogger("edgeinfer.serve")


class _Loaded:
    """The backend, loaded in the background while /health says 503."""

    def __init__(self, load: Callable, on_error: Callable):
        self.backend: Backend | None = None
        self.error = self.fingerprint = None
        self._thread = threading.Thread(target=self._load, args=(load, on_error), name="edgeinfer-load", daemon=True)

    def _load(self, load, on_error) -> None:
        try:
            backend = load()
            files = (
                backend.files()
                if isinstance(backend, ModelSet)
                else [f"{name} {info.get('sha256')}" for name, info in sorted(backend.manifest.files.items())]
            )
            self.fingerprint = fingerprint(__version__, *files)
            self.backend = backend
            log.info("ready: %s", backend.mode)
        except EdgeInferError as e:
            self.error = e
            on_error(e)

    def ready(self) -> Backend:
        if self.backend is None:
            raise RequestError(
                f"the model failed to load: {self.error}" if self.error else "the model is loading: retry shortly",
                status=503,
                code="model_not_ready",
            )
        return self.backend


def create_app(
    load: Callable,
    model_name: str,
    api_key: str | None = None,
    on_load_error: Callable = lambda e: None,
    metrics_key: str | None = None,
    cors_origins: tuple[str, ...] = (),
    body_timeout: float = 30.0,
    ui: bool = True,
    responses_store: responses.StoreLimits = responses.StoreLimits(),
    allow_image_urls: bool = False,
    allowed_image_domains: tuple[str, ...] = (),
) -> FastAPI:
    """`load()` returns the Backend (backend.py: the SDK's Scheduler, or replicas.Replicas); it runs
    in the background from startup, and an EdgeInferError it raises goes to `on_load_error` (the
    server stops on it). A request's `response_headers` go on its response. `api_key` guards /v1/,
    `metrics_key` /metrics; browsers of `cors_origins` may call the API; a body must arrive
    within `body_timeout` seconds (guard.py). With `ui`, GET / is the chat page (serve/ui).
    `responses_store` bounds the Responses API's stored responses; with `allow_image_urls` an http(s)
    image a request names is fetched from a public address, with `allowed_image_domains` from those
    hosts only (image_urls.py); else refused (a data: URL is the image itself)."""
    loaded, metrics = _Loaded(load, on_load_error), Metrics()
    fetcher = ImageFetcher(allowed_image_domains) if allow_image_urls or allowed_image_domains else None
    routes = _Routes(loaded, metrics, model_name, responses_store, fetcher)

    async def lifespan(app):
        loaded._thread.start()
        yield
        routes.embedding.close()
        if fetcher is not None:
            fetcher.close()
        if loaded.backend is not None:
            loaded.backend.close(grace=0)

    app = FastAPI(
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        title="edgeinfer",
        version=__version__,
        description="OpenAI-compatible chat and text completions over an edgeinfer export, with continuous batching.",
    )
    app.state.loaded = loaded
    app.openapi = lambda: _openapi(app, loaded.backend.names if isinstance(loaded.backend, ModelSet) else [model_name])
    app.add_middleware(
        Guard,
        api_key=api_key,
        metrics_key=metrics_key,
        metrics=metrics,
        cors_origins=cors_origins,
        body_timeout=body_timeout,
        routes=lambda: app.routes,
    )
    _add_error_handlers(app)
    _add_routes(app, routes)
    if ui:
        _add_page(app)
    return app


UI = Path(__file__).parent / "ui"
UI_ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8", "favicon.svg": "image/svg+xml"}
# The page loads only its own files, talks only to this server, and runs no inline script or
# style: what a model writes cannot run even if it reached the page as markup.
UI_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _add_page(app: FastAPI) -> None:
    """GET / (the chat page), /ui/ (its script, style and icon) and /ui/vendor/ (its libraries, fetched
    at build time: serve/ui_vendor.py), all files of the package: no CDN, nothing fetched at run time."""
    assets = {name: (UI / name).read_bytes() for name in UI_ASSETS}
    libraries = page_libraries()
    tags = "".join(_library_tag(name) for name in libraries)
    page = (UI / "index.html").read_text().replace("<!-- libraries -->", tags).encode()

    @app.get("/", include_in_schema=False)
    async def chat_page():
        return Response(page, media_type="text/html; charset=utf-8", headers=UI_HEADERS)

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon():  # what browsers ask for on their own: the page's icon
        return Response(assets["favicon.svg"], media_type=UI_ASSETS["favicon.svg"], headers=UI_HEADERS)

    @app.get("/ui/{name}", include_in_schema=False)
    async def chat_page_asset(name: str):
        if name not in assets:
            raise StarletteHTTPException(404)
        return Response(assets[name], media_type=UI_ASSETS[name], headers=UI_HEADERS)

    @app.get("/ui/vendor/{name}", include_in_schema=False)
    async def chat_page_library(name: str):
        if name not in libraries:
            raise StarletteHTTPException(404)
        return Response(libraries[name], media_type=UI_ASSETS["app.js" if name.endswith(".js") else "style.css"], headers=UI_HEADERS)


def page_libraries() -> dict[str, bytes]:
    """The page's libraries as {file name: bytes}, in the lock's order; none where the build could not
    fetch them (the page then shows replies as plain text)."""
    locked = ui_vendor.lock()
    if not ui_vendor.present(ui_vendor.VENDOR, locked):
        return {}
    names = [name for package in locked["packages"] for name in package["files"].values() if name.endswith((".js", ".css"))]
    return {name: (ui_vendor.VENDOR / name).read_bytes() for name in names}


def _library_tag(name: str) -> str:
    if name.endswith(".css"):
        return f'<link rel="stylesheet" href="/ui/vendor/{name}">\n'
    return f'<script src="/ui/vendor/{name}" defer></script>\n'


def _add_routes(app: FastAPI, routes: _Routes) -> None:
    loaded, metrics, model_name = routes.loaded, routes.metrics, routes.model_name

    @app.get("/health")
    async def health():
        served = loaded.ready()
        if isinstance(served, ModelSet):
            return {"status": "ok", "models": served.names, "mode": served.mode}
        return {"status": "ok", "model": model_name, "mode": served.mode}

    @app.get("/metrics")
    async def prometheus():
        served = loaded.backend.stats() if loaded.backend is not None else {}
        return Response(metrics.render({**served, **routes.stored.stats(), **routes.embedding.stats()}), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": routes.listing()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        found = next((entry for entry in routes.listing() if entry["id"] == model_id), None)
        if found is None:
            served = ", ".join(repr(entry["id"]) for entry in routes.listing())
            raise RequestError(f"the model '{model_id}' is not served here: the models are {served}", "model", 404, "model_not_found")
        return found

    for api in APIS.values():
        if api.reply is not None:
            _add_turn_route(app, routes, api)

    @app.post("/v1/embeddings", openapi_extra=_body_of(openai.EmbeddingRequest))
    async def embeddings(http: HTTPRequest):
        return await routes.embeddings(await _read(http, openai.EmbeddingRequest), http)

    _add_counting_routes(app, routes)
    _add_llama_routes(app, routes)


def _add_turn_route(app: FastAPI, routes: _Routes, api: Api) -> None:
    """POST `api.path`: its body read and run by the one route of every generation API."""

    async def turn(http: HTTPRequest):
        return await routes.turn(await _read(http, api.request), api, http)

    name = api.path.removeprefix("/v1/").replace("/", "_")
    app.post(api.path, openapi_extra=_body_of(api.request), name=name)(turn)


def _add_counting_routes(app: FastAPI, routes: _Routes) -> None:
    """What a prompt would count (Anthropic's and the Responses API's), and a stored response
    read back or forgotten."""

    @app.post("/v1/messages/count_tokens", openapi_extra=_body_of(anthropic.CountTokensRequest))
    async def count_tokens(http: HTTPRequest):
        body = await _read(http, anthropic.CountTokensRequest)
        backend, _ = await routes.served(body.model)
        _, ids = await routes.rendered(backend, body, body.conversation(), body.template_kwargs())
        budget(backend.tokenizer, ids, body.reasoning_budget)  # a thought's budget refused here as /v1/messages refuses it
        return {"input_tokens": len(ids)}

    @app.post("/v1/responses/input_tokens", openapi_extra=_body_of(responses.InputTokensRequest))
    async def response_input_tokens(http: HTTPRequest):
        body = await _read(http, responses.InputTokensRequest)
        backend, _ = await routes.served(routes.named(body.model))
        items = [*routes.stored.history(body.previous_response_id), *body.items()]
        conversation = responses.conversation(body.instructions, items)
        _, ids = await routes.rendered(backend, body, conversation, body.template_kwargs(), param="input")
        budget(backend.tokenizer, ids, body.thinking_token_budget)  # refused here as /v1/responses refuses it
        return {"object": "response.input_tokens", "input_tokens": len(ids)}

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str):
        return routes.stored.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        routes.stored.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _add_llama_routes(app: FastAPI, routes: _Routes) -> None:
    """llama.cpp's server endpoints (serve/llama.py), under the API key as /v1/ is."""

    @app.post("/tokenize", openapi_extra=_body_of(llama.TokenizeRequest))
    async def tokenize(http: HTTPRequest):
        body = await _read(http, llama.TokenizeRequest)
        backend, _ = await routes.served(routes.named(body.model))
        if body.messages is not None:
            ids = (await routes.rendered(backend, body, body.conversation(), template_variables(body.chat_template_kwargs)))[1]
        else:
            text, field = (body.content, "content") if body.content is not None else (body.prompt, "prompt")
            try:  # refused before it is encoded where it cannot fit the context, as the other counting routes refuse it
                ids = await _in_thread(backend.tokenizer.encode_within, text, backend.max_context, body.adds_special)
            except ContextLengthError as error:
                raise RequestError(str(error), field, code="context_length_exceeded") from None
        return llama.tokens_reply(ids, backend.tokenizer.token_bytes, backend.max_context, body.with_pieces)

    @app.post("/detokenize", openapi_extra=_body_of(llama.DetokenizeRequest))
    async def detokenize(http: HTTPRequest):
        body = await _read(http, llama.DetokenizeRequest)
        backend, _ = await routes.served(routes.named(body.model))
        llama.check_ids(body.tokens, backend.manifest.vocab_size)
        return {"content": backend.tokenizer.decode_all(body.tokens)}

    @app.post("/apply-template", openapi_extra=_body_of(llama.ApplyTemplateRequest))
    async def apply_template(http: HTTPRequest):
        body = await _read(http, llama.ApplyTemplateRequest)
        backend, _ = await routes.served(routes.named(body.model))
        kwargs = template_variables(body.chat_template_kwargs)
        if not body.add_generation_prompt:  # the conversation as the template closes it
            return {"prompt": await _in_thread(closed_text, backend.tokenizer, body.conversation(), body.tool_request(), kwargs)}
        return {"prompt": (await routes.rendered(backend, body, body.conversation(), kwargs))[0]}

    @app.get("/props")
    async def props(model: str | None = None):
        name = routes.named(model)
        backend, _ = await routes.served(name)
        return llama.props_reply(name, backend, __version__)


async def _in_thread(call, *args):
    return await asyncio.get_running_loop().run_in_executor(None, call, *args)


class _Routes:
    """What the generation routes share: the backend once loaded, the metrics, the model's name."""

    def __init__(
        self, loaded: _Loaded, metrics: Metrics, model_name: str, store: responses.StoreLimits, images: ImageFetcher | None = None
    ):
        self.loaded, self.metrics, self.model_name = loaded, metrics, model_name
        self.images = images  # fetches the http(s) images a request names (None: refused)
        self.stored = responses.Store(store)  # the Responses API's stored responses, for previous_response_id and GET
        self.embedding = backends.EmbeddingWork()

    async def served(self, model: str) -> tuple[Backend, str]:
        """The backend that serves `model`, and the name replies carry: the one model served, or
        the pool's model of that name, loaded on a worker thread (404 naming the models otherwise)."""
        served = self.loaded.ready()
        if isinstance(served, ModelSet):
            return await asyncio.get_running_loop().run_in_executor(None, served.prepared, model), model
        base, _, adapter = model.rpartition(":")
        if model != self.model_name and base == self.model_name:
            return with_adapter(served, base, adapter), model
        self.check_model(model)
        return served, self.model_name

    def listing(self) -> list[dict]:
        """/v1/models' entries: each model served and its adapters."""
        backend = self.loaded.backend
        if isinstance(backend, ModelSet):
            return backend.listing()
        base = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "edgeinfer"}
        if backend is None:  # still loading: its name only
            return [base]
        held = held_bytes(backend)
        loaded = {"loaded": True, **({"memory_bytes": held} if held is not None else {})}
        entry = {**base, **model_fields(backend.manifest, folder_of(backend)), **loaded}
        return [entry, *adapter_entries(self.model_name, backend.manifest)]

    def named(self, model: str | None) -> str:
        """The model a request names, or where it names none the one model served (400 with several)."""
        served = self.loaded.ready()
        if model is None and isinstance(served, ModelSet):
            raise RequestError(f"model is required: this server serves {', '.join(repr(n) for n in served.names)}", "model")
        return self.model_name if model is None else model

    async def rendered(
        self, backend: Backend, body, conversation: list[dict], kwargs: dict, param: str = "messages"
    ) -> tuple[str, list[int]]:
        """(text, ids) of the prompt a chat turn of `conversation`, with `body`'s tools and the
        template variables `kwargs`, would prefill, rendered as the chat routes render it (on a
        worker thread): what the counting routes count. `param`: the field that holds the conversation."""
        turn = await _turn(backend, await self.pictured(backend, conversation, param), body.tool_request(), kwargs)
        return turn.text, turn.ids

    async def pictured(self, backend: Backend, conversation: list[dict], param: str) -> list[dict]:
        """`conversation` with its remote images fetched where this server fetches them (else a
        RequestError naming `param`); a text-only model's as it is (the SDK refuses its pictures)."""
        if not backend.manifest.vision:
            return conversation
        if self.images is None:
            refuse_urls(conversation, param)
            return conversation
        return await self.images.fetched(conversation, param)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise RequestError(
                f"the model '{model}' is not served here: this server serves '{self.model_name}'",
                param="model",
                status=404,
                code="model_not_found",
            )

    async def embeddings(self, body, http: HTTPRequest):
        """OpenAI's embeddings, from a model exported with --task embedding; run on a worker thread."""
        backend, model_name = await self.served(body.model)
        if backend.manifest.task == "embedding" and not hasattr(backend, "embed"):
            raise RequestError(
                f"the model '{model_name}' embeds, and this server's Ray Serve replicas serve generation: serve embedding "
                "models without --ray",
                param="model",
            )
        if backend.manifest.task != "embedding":
            raise RequestError(
                f"the model '{model_name}' generates text; it does not embed: serve a model exported with "
                "`edgeinfer export MODEL -o OUT --task embedding`",
                param="model",
            )
        call = functools.partial(backend.embed, body.input, dimensions=body.dimensions, truncate=body.truncate)
        embeddings = await self.embedding.run(call, lambda: _disconnected(http))
        if embeddings is None:  # the client went away: its work stopped
            return Response(status_code=499)
        return openai.embedding_reply(model_name, embeddings, body.encoding_format)

    async def turn(self, body, api: Api, http: HTTPRequest):
        """A request of any generation API (api.py): its conversation made one chat turn (or, with
        no conversation, its prompts tokenized as they are), its outputs submitted, and its reply
        whole or streamed. An error raised is answered by the app's handler in the API's shape."""
        backend, model_name = await self.served(body.model)
        if api.conversation is not None:
            conversation = await self.pictured(backend, api.conversation(body, self.stored), api.prompt_field)
            turn, requests = await _submit_turn(backend, body, conversation)
            streams, prompt_tokens = [turn.stream() for _ in requests], len(turn.ids)
        else:
            requests = await backends.submit_all(backend, _completion_work(backend, body, body.prompts(), body.choice_settings()))
            streams, prompt_tokens = [ChatStream(backend.tokenizer) for _ in requests], 0
        reply = api.reply(
            body, Served(model_name, backend.tokenizer, self.loaded.fingerprint, prompt_tokens, len(requests), self.stored)
        )
        headers = getattr(requests[0], "response_headers", None) or None
        if body.stream:
            return StreamingResponse(self.events(requests, reply, streams, api), media_type="text/event-stream", headers=headers)
        results = await self.whole(requests, reply, http, streams)
        if results is None:  # the client went away: nobody reads this
            return Response(status_code=499)
        return JSONResponse(reply.whole(results), headers=headers)

    async def whole(self, requests: list, reply: Reply, http: HTTPRequest, streams: list[ChatStream]) -> list[GenerationResult] | None:
        """Each output's whole turn, split as its stream would be; None where the client went away."""
        pieces = await _whole(requests, http)
        if pieces is None:
            self.cancelled(requests, reply.id, 0)
            return None
        results = [stream.replay(p) for p, stream in zip(pieces, streams)]
        for result in results:
            self.finished(reply.id, result)
        return results

    async def events(self, requests: list, reply: Reply, streams: list[ChatStream], api: Api) -> AsyncIterator[str]:
        """The reply's events: its opening; each piece of each output split by its ChatStream (the
        thought, the text, the calls as they are generated) and its delta's events; each output's
        closing as it ends; the ending. An error once the stream has begun is its last event."""
        results, left, generated = [None] * len(requests), set(range(len(requests))), 0
        try:
            for event in reply.opening():
                yield _sse(event)
            async for index, piece in backends.pieces(requests):
                generated += len(piece.token_ids)
                delta = streams[index].feed(piece)
                for event in reply.delta(index, delta):
                    yield _sse(event)
                if delta.result is not None:
                    left.discard(index)
                    results[index] = delta.result
                    for event in reply.closing(index, delta.result):
                        yield _sse(event)
                    self.finished(reply.id, delta.result)
            for event in reply.ending(results):
                yield _sse(event)
        except EdgeInferError as e:  # the status is sent already: the error goes in the stream
            left.clear()
            for request in requests:
                request.cancel()
            yield _sse(reply.error_event(*from_edgeinfer(e, api.prompt_field, api.names)[:2]))
        finally:
            if left:  # the client went away: the rows are freed at the scheduler's next step
                self.cancelled([requests[i] for i in sorted(left)], reply.id, generated)

    def cancelled(self, requests: list, request_id: str, num_generated: int) -> None:
        for request in requests:
            request.cancel()
            self.metrics.cancelled.inc()
        log.info("%s cancelled: the client went away after %d tokens", request_id, num_generated)

    def finished(self, request_id: str, result: GenerationResult) -> None:
        self.metrics.finished(result.prompt_tokens, len(result.token_ids), result.ttft_s, result.decode_tokens_per_s)
        log.info(
            "%s prompt %d completion %d ttft %.0f ms %.1f tok/s finish %s",
            request_id,
            result.prompt_tokens,
            len(result.token_ids),
            result.ttft_s * 1000,
            result.decode_tokens_per_s,
            result.finish_reason,
        )


def _body_of(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of a route that reads its body itself (_read)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


async def _read(http: HTTPRequest, model: type[BaseModel]) -> BaseModel:
    """The body as `model`, parsed and validated on a worker thread: a large body (60,000
    messages, say) takes longer to validate than the event loop may be held."""
    raw = await http.body()
    return await asyncio.get_running_loop().run_in_executor(None, _validated, raw, model)


def _validated(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """Any body is read as JSON (whatever its Content-Type, as `curl -d` sends it); the errors are
    those FastAPI raises, so that one handler words them."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {}, "ctx": {"error": e.msg}}]
        ) from None
    except (RecursionError, UnicodeDecodeError) as e:
        detail = "the JSON is nested too deep" if isinstance(e, RecursionError) else "the body is not UTF-8"
        raise StarletteHTTPException(400, detail) from None
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])} for error in e.errors()]) from None


def _openapi(app: FastAPI, model_names: list[str]) -> dict:
    """FastAPI's description of the routes and request bodies (those of the table's APIs, and
    llama.cpp's), with a required `model` one of the models served."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        bodies = [body for api in APIS.values() for body in (api.request, *api.bodies)] + list(llama.REQUESTS)
        _, models = models_json_schema([(m, "validation") for m in bodies], ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(models["$defs"])
        for body in bodies:
            described = schema["components"]["schemas"][body.__name__]
            if "model" in described.get("required", []):
                described["properties"]["model"]["enum"] = list(model_names)
    return app.openapi_schema


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal in the shape of the API asked (guard.answer), with the field it is about in `param`."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HTTPRequest, error: RequestValidationError):
        return answer(request.url.path, error_body(*_validation_message(error.errors()[0], error.errors())), 400)

    @app.exception_handler(RequestError)
    async def refused(request: HTTPRequest, error: RequestError):
        return refusal(error, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def not_here(request: HTTPRequest, error: StarletteHTTPException):
        where = f"{request.method} {request.url.path}"
        headers = error.headers
        if error.status_code == 405:  # every method of the path's routes, not only the first route's
            allow = ", ".join([*_methods_at(request.app, request.url.path), "OPTIONS"])
            if request.method == "OPTIONS":  # what may be asked here (a browser's preflight is guard.py's)
                return Response(status_code=204, headers={"allow": allow})
            headers = {**{k: v for k, v in (headers or {}).items() if k.lower() != "allow"}, "allow": allow}
        if error.status_code == 404:
            message, code = f"Invalid URL ({where}): the API is {', '.join(_api_paths(request.app))}", "unknown_url"
        elif error.status_code == 405:
            message, code = f"{where}: the method is not allowed here: use {allow}", "method_not_allowed"
        else:  # the body could not be read as JSON (nested too deep for the parser, say)
            message, code = f"{where}: {error.detail}: send a JSON object", None
        return answer(request.url.path, error_body(message, code=code), error.status_code, headers)

    @app.exception_handler(EdgeInferError)
    async def engine_error(request: HTTPRequest, error: EdgeInferError):
        api = api_of(request.url.path) or openai.CHAT  # llama.cpp's routes word errors as chat's
        status, body, headers = from_edgeinfer(error, api.prompt_field, api.names)
        return answer(request.url.path, body, status, headers)


def _methods_at(app: FastAPI, path: str) -> list[str]:
    """The methods the app's routes take at `path` (HEAD left out)."""
    methods = {
        m for route in app.routes if getattr(route, "path_regex", None) and route.path_regex.match(path) for m in route.methods or ()
    }
    return sorted(methods - {"HEAD"})


def _api_paths(app: FastAPI) -> list[str]:
    """The API's paths, read off the routes (the page's and the OpenAPI document's left out)."""
    return sorted({route.path for route in app.routes if getattr(route, "include_in_schema", False)})


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*|constrained-.*|[A-Z]\w*|literal\[.*\])$")
_FORMS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean", "none": "null"}
_MISFITS = {"int_from_float", "literal_error", "extra_forbidden", "missing", "union_tag_invalid"}  # a value of another form


def _validation_message(first: dict, errors: list[dict] = ()) -> tuple[str, str, str | None]:
    """(message, type, param) of pydantic's first complaint about a body; where a field fits none
    of a union's forms (`errors` has one complaint per form), the forms it takes, in words."""
    loc = [part for part in first["loc"][1:] if not (isinstance(part, str) and _UNION_TAG.match(part))]
    field = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or None
    text = first["msg"].removeprefix("Value error, ")
    forms = _union_forms(first, errors)
    if field is not None and len(forms) > 1:
        depth = len(first["loc"]) - 1
        near = next(
            (
                e
                for e in errors
                if e["loc"][:depth] == first["loc"][:depth] and e["type"] not in _MISFITS and not e["type"].endswith("_type")
            ),
            None,
        )
        if near is not None:  # the value has one of the forms but breaks its rule (an empty string, say)
            return _validation_message(near)
        return f"{field} must be {', '.join(forms[:-1])} or {forms[-1]}", "invalid_request_error", field
    if first["type"] == "json_invalid":
        at = f" at byte {first['loc'][1]}" if len(first["loc"]) > 1 else ""
        return (
            f"the body is not valid JSON ({first.get('ctx', {}).get('error', text)}{at}): send a JSON object",
            "invalid_request_error",
            None,
        )
    if first["type"] == "extra_forbidden":
        return f"unknown parameter '{field}'", "invalid_request_error", field
    if field is None:
        return f"the request body: {text} (send a JSON object)", "invalid_request_error", None
    return f"{field}: {text}", "invalid_request_error", field


def _union_forms(first: dict, errors: list[dict]) -> list[str]:
    """The forms of the union `first` complains of, in words ("a string", "a list of integers"),
    read off pydantic's tags (str, constrained-int, list[constrained-str]) of its complaints."""
    depth = len(first["loc"]) - 1
    tag = first["loc"][depth] if depth > 0 and isinstance(first["loc"][depth], str) else None
    if tag is None or not _UNION_TAG.match(tag):
        return []
    prefix, forms = first["loc"][:depth], []
    for error in errors:
        if tuple(error["loc"][:depth]) == tuple(prefix) and len(error["loc"]) > depth and isinstance(error["loc"][depth], str):
            form = _form(error["loc"][depth])
            if form not in forms:
                forms.append(form)
    return forms


def _form(tag: str) -> str:
    tag = tag.replace("constrained-", "")
    if tag.startswith("list[") and tag.endswith("]"):
        inner = _form(tag[5:-1]).removeprefix("a ").removeprefix("an ")
        return f"a list of {inner}s" if not inner.startswith("list") else f"a list of {inner.replace('list of', 'lists of', 1)}"
    if re.fullmatch(r"[A-Z]\w*", tag):  # a model of the protocol: TextPart is "a text part"
        words = re.sub(r"(?<!^)([A-Z])", r" \1", tag).lower()
        return f"an {words}" if words[0] in "aeiou" else f"a {words}"
    return _FORMS.get(tag, tag)


async def _turn(backend: Backend, conversation: list[dict], request, kwargs: dict, asked: int | None = None) -> ChatTurn:
    """The chat turn of `conversation` (its images fetched: _Routes.pictured) with the tools
    `request` asks for and the template variables `kwargs` (sdk/chat.py), with room for `asked`
    tokens: on a worker thread, as the template, the tokenizer and the images take time."""

    def made() -> ChatTurn:
        vision = backend.manifest.vision or None
        turn = chat_turn(backend.tokenizer, backend.max_context, conversation, request, kwargs, vision)
        check_room(len(turn.ids), asked, backend.max_context)
        return turn

    return await _in_thread(made)


async def _submit_turn(backend: Backend, body, conversation: list[dict]) -> tuple[ChatTurn, list]:
    """A chat request's turn (`_turn`, with its body's tools, template variables and tokens
    asked), and its choices submitted, each with the turn's constraint (ChatTurn.settings) and
    its pictures (encoded by the backend where it does not hold them yet)."""
    turn = await _turn(backend, conversation, body.tool_request(), body.template_kwargs(), body.asked_tokens)
    pictures = {"pictures": turn.pictures} if turn.pictures else {}
    return turn, await backends.submit_all(
        backend, lambda: [(turn.ids, {**turn.settings(c), **pictures}) for c in body.choice_settings()]
    )


def _completion_work(backend: Backend, body, prompts: list, choices: list[dict]) -> Callable:
    """What submits every choice of every prompt of a completion (on a worker thread: encoding
    long prompts takes time), each prompt with room for the tokens asked."""

    def work() -> list[tuple[list[int], dict]]:
        tokenizer, context = backend.tokenizer, backend.max_context
        ids = [tokenizer.prompt_ids(p, backend.manifest.vocab_size, context) for p in prompts]
        for prompt in ids:
            check_room(len(prompt), body.asked_tokens, context)
        return [(prompt, choice) for prompt in ids for choice in choices]

    return work


async def _whole(requests: list, http: HTTPRequest) -> list[list[Piece]] | None:
    """Every request's pieces, or None once the client has gone away (the caller cancels them)."""

    async def collect() -> list[list[Piece]]:
        pieces = [[] for _ in requests]
        async for index, piece in backends.pieces(requests):
            pieces[index].append(piece)
        return pieces

    results, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(_disconnected(http))
    done, _ = await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
    if results not in done:
        results.cancel()
        return None
    gone.cancel()
    try:
        return results.result()
    except EdgeInferError:
        for request in requests:
            request.cancel()
        raise


async def _disconnected(http: HTTPRequest) -> None:
    """Returns when the client has closed its connection (the body has been read by then)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _sse(event: Event) -> str:
    """A server-sent event: `event: NAME` where it has a name, then its data (JSON, or text as `[DONE]`)."""
    name, data = event
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"event: {name}\ndata: {text}\n\n" if name else f"data: {text}\n\n"
