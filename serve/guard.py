"""What every HTTP request passes before a route sees it, as plain ASGI (a streamed response
passes through untouched):

- CORS: a preflight from an origin given with --cors-origin is answered here, without a key (the
  Fetch standard sends none); the other responses to such an origin carry its allow headers.
- Keys: /v1/ (and llama.cpp's /tokenize, /detokenize, /apply-template, /props) needs the API
  key, /metrics the metrics key, where they are set (compared in constant time); /health stays open
  for probes.
- The body: read whole here, at most MAX_BODY bytes (413, with or without a Content-Length) and
  within `body_timeout` seconds (408), then handed on.
- /metrics counts every response by route and status; a path that is no route counts as "other",
  so requests to random paths cannot grow it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from fastapi.responses import JSONResponse, Response

from .apis import api_of
from .checks import RequestError, error_body
from .metrics import Metrics

log = logging.getLogger("edgeinfer.serve")
MAX_BODY = 4 * 1024 * 1024  # bytes of a request body
PREFLIGHT_MAX_AGE = 600  # seconds a browser may keep a preflight's answer
EXPOSED = "retry-after, x-edgeinfer-replica"  # response headers a page may read
CLOSE = {"connection": "close"}
API_PATHS = (
    "/v1/",
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/props",
)  # what the API key guards (prefixes)  # after a refusal whose body was not read whole


class Guard:
    def __init__(
        self,
        app,
        metrics: Metrics,
        routes,
        api_key: str | None = None,
        metrics_key: str | None = None,
        cors_origins: tuple[str, ...] = (),
        body_timeout: float = 30.0,
    ):
        """`routes()`: the app's routes, whose paths label /metrics."""
        self.app, self.metrics, self._routes = app, metrics, routes
        self.keys = {**{path: _encoded(api_key) for path in API_PATHS}, "/metrics": _encoded(metrics_key)}
        self.cors_origins, self.body_timeout = frozenset(cors_origins), body_timeout
        self._paths: frozenset[str] | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers, status = dict(scope["headers"]), []
        origin = self._allowed_origin(headers)

        async def counted(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
                if origin is not None:
                    message = {**message, "headers": [*message.get("headers", []), *_cors_headers(origin)]}
            await send(message)

        try:
            await self._serve(scope, receive, counted, headers, origin)
        except Exception as error:  # noqa: BLE001 - a bug anywhere below: answered here, in the API's shape
            if status:  # a response had begun (a stream): it cannot be finished, so the connection goes
                raise
            await self._bug(scope, error)(scope, receive, counted)
        finally:  # no response at all: the client went away first (nginx's 499)
            self.metrics.requests.labels(self._label(scope["path"]), str(status[0] if status else 499)).inc()

    async def _serve(self, scope, receive, send, headers: dict, origin: str | None) -> None:
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers and b"origin" in headers:
            return await self._preflight(headers, origin)(scope, receive, send)
        refused = self._refusal(scope["path"], headers)
        if refused is not None:
            return await refusal(refused, path=scope["path"])(scope, receive, send)
        try:
            body = await asyncio.wait_for(_read_body(receive), self.body_timeout)
        except RequestError as error:
            return await refusal(error, CLOSE, scope["path"])(scope, receive, send)
        except asyncio.TimeoutError:
            error = RequestError(
                f"the request body did not arrive within {self.body_timeout:g} s: send it at once", status=408, code="request_timeout"
            )
            return await refusal(error, CLOSE, scope["path"])(scope, receive, send)
        if body is None:  # the client went away while sending it
            return None
        await self.app(scope, _replay(body, receive), send)

    @staticmethod
    def _bug(scope, error: Exception) -> JSONResponse:
        """The 500 of an exception no handler took, answered here rather than by Starlette's outer
        handler, which re-raises it after answering, so that the server drops a kept-alive
        connection without a word; the log has the traceback."""
        log.error("%s %s failed", scope["method"], scope["path"], exc_info=error)
        message = f"the server failed ({type(error).__name__}): this is a bug in edgeinfer, please report it with the server's log"
        return refusal(RequestError(message, status=500, code="server_error"), path=scope["path"])

    def _refusal(self, path: str, headers: dict) -> RequestError | None:
        for prefix, expected in self.keys.items():
            if (
                expected is not None
                and path.startswith(prefix)
                and not hmac.compare_digest(_bearer_token(headers), expected)
                and not (prefix != "/metrics" and hmac.compare_digest(headers.get(b"x-api-key", b""), expected))
            ):
                which = "API key" if prefix != "/metrics" else "metrics key"
                way = "'Authorization: Bearer KEY' (or 'x-api-key: KEY')" if prefix != "/metrics" else "'Authorization: Bearer KEY'"
                return RequestError(f"a valid {which} is needed: send {way}", status=401, code="invalid_api_key")
        length = headers.get(b"content-length", b"0")
        if not length.isdigit():
            return RequestError(f"Content-Length {length.decode(errors='replace')!r} is not a number of bytes")
        if int(length) > MAX_BODY:
            return _too_large()
        return None

    def _allowed_origin(self, headers: dict) -> str | None:
        """The request's Origin where CORS allows it ("*" where any origin is allowed), else None."""
        origin = headers.get(b"origin", b"").decode("latin-1")
        if not origin or not self.cors_origins:
            return None
        if origin in self.cors_origins:
            return origin
        return "*" if "*" in self.cors_origins else None

    def _preflight(self, headers: dict, origin: str | None) -> Response:
        if origin is None:
            asked = headers[b"origin"].decode("latin-1")
            return JSONResponse(
                error_body(
                    f"the origin {asked} may not call this server: start it with --cors-origin {asked}", code="cors_origin_not_allowed"
                ),
                status_code=403,
            )
        asked_headers = headers.get(b"access-control-request-headers", b"authorization, content-type").decode("latin-1")
        return Response(
            status_code=204,
            headers={
                "access-control-allow-methods": "GET, POST, DELETE, OPTIONS",
                "access-control-allow-headers": asked_headers,
                "access-control-max-age": str(PREFLIGHT_MAX_AGE),
            },
        )

    def _label(self, path: str) -> str:
        if self._paths is None:
            self._paths = frozenset(route.path for route in self._routes())
        return path if path in self._paths else "other"


def _encoded(key: str | None) -> bytes | None:
    return None if key is None else key.encode()


def _bearer_token(headers: dict) -> bytes:
    """The token of an 'Authorization: Bearer TOKEN' header, the scheme in any case (RFC 7235)."""
    scheme, _, token = headers.get(b"authorization", b"").strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b"\x00"  # never a key: keys are text


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [
        (b"access-control-allow-origin", origin.encode("latin-1")),
        (b"vary", b"Origin"),
        (b"access-control-expose-headers", EXPOSED.encode()),
    ]


async def _read_body(receive) -> bytes | None:
    """The whole body (None if the client disconnected first); RequestError past MAX_BODY."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_BODY:
            raise _too_large()
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    """`receive` that gives the body read already, then what the connection says next (its
    disconnect, which a response may wait for)."""
    given = False

    async def replay():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _too_large() -> RequestError:
    return RequestError(f"the request body is over {MAX_BODY} bytes: send less", status=413, code="request_too_large")


def refusal(error: RequestError, headers: dict | None = None, path: str = "") -> JSONResponse:
    """The refusal in the shape of the API asked (`answer`)."""
    kind = "invalid_request_error" if error.status < 500 else "server_error"
    return answer(path, error_body(str(error), kind, error.param, error.code), error.status, headers)


def answer(path: str, body: dict, status: int, headers: dict | None = None) -> JSONResponse:
    """An error (`body` in OpenAI's shape) in the shape of the API of `path` (apis.py), the one
    place that chooses it."""
    api = api_of(path)
    return JSONResponse(body if api is None else api.error_shape(status, body), status_code=status, headers=headers)
