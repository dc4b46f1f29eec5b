"""Running the app with uvicorn, and stopping it cleanly: the first SIGTERM or Ctrl-C stops the
scheduler taking requests, lets the running ones end within the grace period, ends the rest with
finish reason "length", and only then lets uvicorn close its connections and exit 0.

Clients that stall cannot hold connections: a connection must deliver a request's headers within
`header_timeout` seconds of opening (or of its previous response), else it gets a 408 and is
closed; the body must follow within `body_timeout` (guard.py); an idle kept-alive connection is
closed after uvicorn's `timeout_keep_alive`."""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
from dataclasses import dataclass

import uvicorn

from edgeinfer.sdk.errors import EdgeInferError

from . import ui_vendor
from .app import create_app
from .checks import error_body
from .responses import StoreLimits

log = logging.getLogger("edgeinfer.serve")
KEEP_ALIVE_S = 5  # an idle connection between requests


@dataclass(frozen=True)
class ServerOptions:
    """Who may call the server, and how long a client may take: `api_key` guards /v1/,
    `metrics_key` /metrics (None: open); pages from `cors_origins` may call it ("*": any)."""

    api_key: str | None = None
    metrics_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    grace: float = 30.0
    ui: bool = True  # the chat page at / (serve/ui)
    responses_store: StoreLimits = StoreLimits()  # the Responses API's stored responses
    allow_image_urls: bool = False  # fetch the http(s) images requests name from public addresses (else: data: URLs only)
    allowed_image_domains: tuple[str, ...] = ()  # fetch them from these hosts only (serve/image_urls.py)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, grace: float):
        super().__init__(config)
        self.grace, self._draining = grace, False

    def handle_exit(self, sig, frame) -> None:
        if self._draining:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        self._draining = True
        threading.Thread(target=self._drain, name="edgeinfer-drain", daemon=True).start()

    def _drain(self) -> None:
        backend = self.config.app.state.loaded.backend
        log.info("stopping: no new requests; running ones get %.0f s to finish", self.grace)
        if backend is not None:
            backend.close(self.grace)
        self.should_exit = True


def run_server(load, model_name: str, host: str = "127.0.0.1", port: int = 8000, options: ServerOptions = ServerOptions()) -> None:
    failed = []

    def stop(error):
        failed.append(error)
        server.should_exit = True

    app = create_app(
        load,
        model_name,
        options.api_key,
        stop,
        options.metrics_key,
        options.cors_origins,
        options.body_timeout,
        options.ui,
        options.responses_store,
        options.allow_image_urls,
        options.allowed_image_domains,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_S,
        http=timed_protocol(options.header_timeout),
    )
    server = _Server(config, options.grace)
    bound = _bound(host, port)
    where = f"http://{'[' + host + ']' if ':' in host else host}:{bound.getsockname()[1]}"
    page = _page_line(where) if options.ui else ""
    log.info("listening on %s: %sthe OpenAI API under /v1, Anthropic's at /v1/messages; loading %s", where, page, model_name)
    server.run(sockets=[bound])
    if failed:
        raise failed[0]


def _page_line(where: str) -> str:
    if ui_vendor.present(ui_vendor.VENDOR):
        return f"the chat page at {where}/, "
    return (
        f"the chat page at {where}/ (showing replies as plain text: its Markdown libraries were not fetched when "
        f"edgeinfer was installed; `python -m edgeinfer.serve.ui_vendor` fetches them), "
    )


def _bound(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), as uvicorn binds one; EdgeInferError where the port is taken
    or the address is not this machine's, before anything says the server listens."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise EdgeInferError(f"port {port} on {host} is in use (another server?): stop it, or serve on another --port") from None
        raise EdgeInferError(f"cannot listen on {host}:{port} ({e.strerror}): pass a --host of this machine") from None
    sock.set_inheritable(True)
    return sock


def timed_protocol(header_timeout: float):
    """uvicorn's HTTP protocol (httptools where installed, else h11), with a deadline for each
    request's headers: armed when the connection opens and when a response ends, met when a
    request's headers are complete (uvicorn then starts its cycle)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class TimedProtocol(Base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def data_received(self, data: bytes) -> None:
            self._heard = True
            super().data_received(data)

        def connection_lost(self, exc) -> None:
            if getattr(self, "_deadline", None) is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if getattr(self, "_deadline", None) is not None:
                self._deadline.cancel()
            self._waiting_after, self._heard = self.cycle, False
            self._deadline = self.loop.call_later(header_timeout, self._expire)

        def _expire(self) -> None:
            """No new request since the deadline was armed, and none running: the headers are late."""
            idle = self.cycle is None or self.cycle.response_complete
            if self.cycle is self._waiting_after and idle and not self.transport.is_closing():
                if self._heard:  # part of a request came: say why it is closed
                    self.transport.write(_timeout_response(header_timeout))
                self.transport.close()

    return TimedProtocol


def _timeout_response(seconds: float) -> bytes:
    body = json.dumps(error_body(f"the request's headers did not arrive within {seconds:g} s", code="request_timeout")).encode()
    return (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
