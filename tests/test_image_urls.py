"""Image URLs a client names, fetched by the server's ImageFetcher (serve/image_urls.py) by its
rules, against real HTTP servers on 127.0.0.1 that answer well, slowly, never, too much, or with a
redirect: loopback and the other non-public addresses refused unless their host is named, every
redirect checked again, one deadline for the whole download, errors in the client's terms. No
traffic leaves 127.0.0.1: a refused host is refused before any connection."""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
import time

import pytest

from edgeinfer.serve.checks import RequestError
from edgeinfer.serve.image_urls import MAX_FETCHED, ImageFetcher, is_public

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64  # the bytes only: decoding is the SDK's (tests/test_vision.py)


class Site:
    """A web server on 127.0.0.1 whose paths behave as the tests need; `asked` lists the paths requested."""

    def __init__(self):
        self.asked: list[str] = []
        site = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                site.asked.append(self.path)
                getattr(site, "_" + self.path.strip("/").split("?")[0].replace("-", "_").replace(".", "_"))(self)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    @staticmethod
    def _answer(handler, status: int, body: bytes = b"", **headers) -> None:
        handler.send_response(status)
        for name, value in {"Content-Type": "image/png", "Content-Length": str(len(body)), **headers}.items():
            handler.send_header(name.replace("_", "-"), value)
        handler.end_headers()
        handler.wfile.write(body)

    def _p_png(self, handler):
        self._answer(handler, 200, PNG)

    def _forbidden(self, handler):
        self._answer(handler, 403, b"Forbidden: secret internal service", Content_Type="text/plain")

    def _hop(self, handler):  # /hop?n redirects n more times, then to the picture
        left = int(handler.path.split("?")[1])
        self._answer(handler, 302, Location=f"/hop?{left - 1}" if left > 1 else "/p.png")

    def _to_localhost(self, handler):
        self._answer(handler, 302, Location=self.url("/p.png", "localhost"))

    def _to_metadata(self, handler):
        self._answer(handler, 302, Location="http://169.254.169.254/latest/meta-data/")

    def _trickle(self, handler):  # headers at once, then a byte every 0.3 s for minutes
        handler.send_response(200)
        handler.send_header("Content-Type", "image/png")
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        for _ in range(1000):
            try:
                handler.wfile.write(b"x")
                handler.wfile.flush()
            except OSError:
                return
            time.sleep(0.3)

    def _huge(self, handler):  # no Content-Length: more bytes than an image may have
        handler.send_response(200)
        handler.send_header("Content-Type", "image/png")
        handler.send_header("Connection", "close")
        handler.end_headers()
        for _ in range(MAX_FETCHED // 65536 + 2):
            handler.wfile.write(b"\x00" * 65536)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Silent:
    """A listening socket on 127.0.0.1 that accepts and never answers; `accepted` counts connections."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port, self.accepted, self.held = self.sock.getsockname()[1], 0, []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                connection, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.held.append(connection)

    def close(self):
        self.sock.close()
        for connection in self.held:
            connection.close()


@pytest.fixture(scope="module")
def site():
    running = Site()
    yield running
    running.close()


def fetch(fetcher: ImageFetcher, *urls: str, param: str = "messages") -> list[dict]:
    conversation = [{"role": "user", "content": [{"type": "image", "url": url} for url in urls] + [{"type": "text", "text": "?"}]}]
    return asyncio.run(fetcher.fetched(conversation, param))[0]["content"][: len(urls)]


def refusal(fetcher: ImageFetcher, url: str, param: str = "messages") -> RequestError:
    with pytest.raises(RequestError) as refused:
        fetch(fetcher, url, param=param)
    assert refused.value.param == param and refused.value.status == 400
    return refused.value


@pytest.mark.parametrize(
    "address, public",
    [
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),  # link-local: cloud metadata
        ("100.64.0.1", False),  # shared (carrier-grade NAT)
        ("224.0.0.1", False),
        ("240.0.0.1", False),
        ("0.0.0.0", False),
        ("255.255.255.255", False),
        ("::1", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("ff02::1", False),
        ("::ffff:127.0.0.1", False),  # loopback mapped into IPv6
        ("::ffff:169.254.169.254", False),
        ("8.8.8.8", True),
        ("1.1.1.1", True),
        ("2606:4700:4700::1111", True),
        ("::ffff:8.8.8.8", True),
    ],
)
def test_only_public_addresses_are_public(address, public):
    assert is_public(address) is public


def test_loopback_is_refused_by_default_by_address_and_by_name_before_any_connection(site):
    fetcher = ImageFetcher()
    try:
        for url in (site.url("/p.png"), site.url("/p.png", "localhost"), site.url("/p.png", "[::1]")):
            error = refusal(fetcher, url)
            assert error.code == "image_url_not_allowed" and "only from public addresses" in str(error)
        assert site.asked == []
    finally:
        fetcher.close()


def test_a_named_host_is_fetched_and_its_redirects_checked_again(site):
    fetcher = ImageFetcher(("127.0.0.1",))
    try:
        got = fetch(fetcher, site.url("/p.png"), site.url("/hop?3"))
        assert [(part["image"], part["media_type"]) for part in got] == [(PNG, "image/png")] * 2
        site.asked.clear()
        for path in ("/to-localhost", "/to-metadata"):  # a redirect to a host not named: refused, not followed
            error = refusal(fetcher, site.url(path))
            assert error.code == "image_url_not_allowed" and "only from the hosts it was told to allow" in str(error)
        assert site.asked == ["/to-localhost", "/to-metadata"]
        error = refusal(fetcher, site.url("/hop?4"))
        assert "redirects more than 3 times" in str(error)
        assert refusal(fetcher, site.url("/p.png", "localhost")).code == "image_url_not_allowed"  # another name, not named
    finally:
        fetcher.close()


def test_errors_say_what_went_wrong_in_the_clients_terms_never_the_upstreams(site):
    fetcher = ImageFetcher(("127.0.0.1",))
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: a connection there is refused
    port = closed.getsockname()[1]
    try:
        for url in (site.url("/forbidden"), f"http://127.0.0.1:{port}/p.png"):
            error = refusal(fetcher, url, param="input")
            assert error.code == "image_url_unreachable" and "could not be fetched" in str(error)
            assert not any(word in str(error) for word in ("403", "Forbidden", "secret", "Errno", "refused", "111")), str(error)
        error = refusal(fetcher, site.url("/huge"))
        assert error.code == "image_too_large" and f"over {MAX_FETCHED} bytes" in str(error)
        for url in ("ftp://127.0.0.1/p.png", "http:///p.png", "http://127.0.0.1:99999/p.png"):
            assert refusal(fetcher, url).code == "image_url_not_allowed"
    finally:
        fetcher.close()
        closed.close()


def test_one_deadline_holds_the_whole_download_however_the_host_trickles(site):
    """A byte every 0.3 s (each read well within any per-read timeout) and a host that never
    answers: both end at the deadline (2 s here), as "did not arrive within"."""
    silent = Silent()
    fetcher = ImageFetcher(("127.0.0.1",), deadline_s=2.0)
    try:
        for url in (site.url("/trickle"), f"http://127.0.0.1:{silent.port}/p.png"):
            started = time.monotonic()
            error = refusal(fetcher, url)
            assert error.code == "image_url_timeout" and "did not arrive within 2 s" in str(error)
            assert time.monotonic() - started < 4  # the deadline, not the host, ended it
    finally:
        fetcher.close()
        silent.close()


def test_fetches_wait_for_their_own_pool_and_its_wait_counts_against_the_deadline():
    """A pool of 2 threads and 5 URLs that never answer: 2 connect at once, never more, and all five
    end at the deadline (the three that waited for a thread, without connecting)."""
    silent = Silent()
    fetcher = ImageFetcher(("127.0.0.1",), deadline_s=1.5, threads=2)
    try:
        urls = [f"http://127.0.0.1:{silent.port}/{i}.png" for i in range(5)]
        with pytest.raises(RequestError) as refused:
            fetch(fetcher, *urls)
        assert refused.value.code == "image_url_timeout"
        time.sleep(2.0)  # the others end too
        assert silent.accepted == 2
    finally:
        fetcher.close()
        silent.close()
