"""The HTTP layer: OpenAI requests in, the scheduler's pieces out as one response or as server-sent
events. It translates and nothing more: the scheduler does the batching, protocol.py the shapes."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgeinfer.sdk.errors import EdgeInferError
from edgeinfer.sdk.sequence import GenerationResult

from .metrics import CONTENT_TYPE, Metrics
from .protocol import ChatRequest, CompletionRequest, Reply, RequestError, error_body, from_edgeinfer

log = logging.getLogger("edgeinfer.serve")
MAX_BODY = 4 * 1024 * 1024  # bytes of a request body


class _Loaded:
    """The engine and scheduler, loaded in the background while /health says 503."""

    def __init__(self, load: Callable, on_error: Callable):
        self.engine = self.scheduler = self.error = None
        self._thread = threading.Thread(target=self._load, args=(load, on_error), name="edgeinfer-load", daemon=True)

    def _load(self, load, on_error) -> None:
        try:
            self.engine, self.scheduler = load()
            log.info("ready: %s", self.scheduler.mode)
        except EdgeInferError as e:
            self.error = e
            on_error(e)

    def ready(self):
        if self.scheduler is None:
            raise RequestError(f"the model failed to load: {self.error}" if self.error else "the model is loading: retry shortly",
                               status=503, code="model_not_ready")
        return self.engine, self.scheduler


def create_app(load: Callable, model_name: str, api_key: str | None = None, on_load_error: Callable = lambda e: None) -> FastAPI:
    """`load()` returns (engine, scheduler); it runs in the background from startup, and an
    EdgeInferError it raises goes to `on_load_error` (the server stops on it). The scheduler is
    the SDK's, or one with its `submit` whose requests run elsewhere (replicas.Replicas): a
    request's `response_headers`, where it has them, go on its response."""
    loaded, metrics = _Loaded(load, on_load_error), Metrics()

    async def lifespan(app):
        loaded._thread.start()
        yield
        if loaded.scheduler is not None:
            loaded.scheduler.close(grace=0)

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.loaded = loaded

    app.add_middleware(_Guard, api_key=api_key, metrics=metrics)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"] if part != "body") or None
        message = f"unknown parameter '{field}'" if first["type"] == "extra_forbidden" else f"{field}: {first['msg']}"
        return JSONResponse(error_body(message, param=field), status_code=400)

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError):
        return _refusal(error)

    @app.exception_handler(StarletteHTTPException)
    async def not_here(request: Request, error: StarletteHTTPException):
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {error.detail}", code=str(error.status_code)),
                            status_code=error.status_code)

    @app.exception_handler(EdgeInferError)
    async def engine_error(request: Request, error: EdgeInferError):
        status, body, headers = from_edgeinfer(error)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.get("/health")
    async def health():
        engine, scheduler = loaded.ready()
        return {"status": "ok", "model": model_name, "mode": scheduler.mode}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(loaded.scheduler), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "edgeinfer"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        return await _generate(body, lambda engine: engine.chat_prompt(body.conversation()), chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await _generate(body, lambda engine: body.prompt, chat=False)

    async def _generate(body, prompt_of: Callable, chat: bool):
        engine, scheduler = loaded.ready()
        if body.model != model_name:
            raise RequestError(f"the model '{body.model}' is not served here: this server serves '{model_name}'",
                               param="model", status=404, code="model_not_found")
        try:
            request = await _submit(scheduler, prompt_of(engine), body.settings())
        except EdgeInferError as e:
            status, error, headers = from_edgeinfer(e, "messages" if chat else "prompt")
            return JSONResponse(error, status_code=status, headers=headers)
        reply, headers = Reply(chat, model_name, engine.tokenizer.token_bytes), getattr(request, "response_headers", None)
        if body.stream:
            return StreamingResponse(_events(request, reply, body.include_usage), media_type="text/event-stream", headers=headers)
        try:
            result = GenerationResult.from_pieces([piece async for piece in _pieces(request)])
        except EdgeInferError as e:
            status, error, more = from_edgeinfer(e)
            return JSONResponse(error, status_code=status, headers={**(headers or {}), **more})
        _finished(reply.id, result.prompt_tokens, len(result.token_ids), result.ttft_s, result.decode_tokens_per_s, result.finish_reason)
        return JSONResponse(reply.whole(result), headers=headers)

    async def _events(request, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
        made, ended = 0, False
        try:
            if (first := reply.first_chunk()) is not None:
                yield _sse(first)
            async for piece in _pieces(request):
                made += len(piece.token_ids)
                if piece.text:
                    yield _sse(reply.piece_chunk(piece))
                if piece.finish_reason is not None:
                    yield _sse(reply.last_chunk(piece.finish_reason))
                    if include_usage:
                        yield _sse(reply.usage_chunk(piece.prompt_tokens, made, piece))
                    _finished(reply.id, piece.prompt_tokens, made, piece.ttft_s, piece.decode_tokens_per_s, piece.finish_reason)
                    ended = True
            yield "data: [DONE]\n\n"
        except EdgeInferError as e:  # the status is sent already: the error goes in the stream
            ended = True
            yield _sse(from_edgeinfer(e)[1])
        finally:
            if not ended:  # the client went away: its row is freed at the scheduler's next step
                request.cancel()
                metrics.cancelled.inc()
                log.info("%s cancelled: the client went away after %d tokens", reply.id, made)

    def _finished(request_id: str, prompt_tokens: int, made: int, ttft_s: float, tokens_per_s: float, finish: str) -> None:
        metrics.finished(prompt_tokens, made, ttft_s, tokens_per_s)
        log.info("%s prompt %d completion %d ttft %.0f ms %.1f tok/s finish %s", request_id, prompt_tokens, made,
                 ttft_s * 1000, tokens_per_s, finish)

    return app


class _Guard:
    """Plain ASGI (a streamed response passes through untouched): the API key and the body's size
    before the app sees a request, and every response's status counted in /metrics."""

    def __init__(self, app, api_key: str | None, metrics: Metrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = []

        async def counted(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        refusal = self._refusal(scope)
        if refusal is not None:
            await _refusal(refusal)(scope, receive, counted)
        else:
            await self.app(scope, _limited(receive), counted)
        self.metrics.requests.labels(scope["path"], str(status[0] if status else 500)).inc()

    def _refusal(self, scope) -> RequestError | None:
        headers = dict(scope["headers"])
        if scope["path"].startswith("/v1/") and self.api_key and headers.get(b"authorization") != f"Bearer {self.api_key}".encode():
            return RequestError("a valid API key is needed: send 'Authorization: Bearer KEY'", status=401, code="invalid_api_key")
        if int(headers.get(b"content-length") or 0) > MAX_BODY:
            return _too_large()
        return None


def _limited(receive):
    """`receive` that refuses a body growing past MAX_BODY (a chunked one has no length to check first)."""
    seen = 0

    async def limited():
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > MAX_BODY:
            raise _too_large()
        return message
    return limited


def _too_large() -> RequestError:
    return RequestError(f"the request body is over {MAX_BODY} bytes", status=413, code="request_too_large")


async def _submit(scheduler, prompt, settings: dict):
    """`scheduler.submit` on a worker thread: compiling a constraint (and, the first time, reading
    the tokenizer for it) may take a second, which the event loop must not wait for. A request
    whose client went away meanwhile is cancelled as soon as it exists."""
    submitted = asyncio.get_running_loop().run_in_executor(None, lambda: scheduler.submit(prompt, **settings))
    try:
        return await asyncio.shield(submitted)
    except asyncio.CancelledError:
        submitted.add_done_callback(lambda done: done.exception() is None and done.result().cancel())
        raise


async def _pieces(request) -> AsyncIterator:
    """The request's pieces, awaited on the event loop (a cancelled await, a client gone, returns
    at once; a thread blocked on the request's own queue could not be cancelled)."""
    loop, arrived = asyncio.get_running_loop(), asyncio.Queue()
    request.forward(lambda item: loop.call_soon_threadsafe(arrived.put_nowait, item))
    while (item := await arrived.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        yield item


def _refusal(error: RequestError) -> JSONResponse:
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return JSONResponse(error_body(str(error), kind, error.param, error.code), status_code=error.status)


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
