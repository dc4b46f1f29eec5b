"""Remote images: the http(s) image URLs a request names, fetched only where the server allows it
(--allow-image-urls, --allowed-image-domains), so that a client cannot turn the box against what
is behind it or hold its threads.

The rules:
- Hosts: with --allowed-image-domains, only the hosts named (and their subdomains), wherever they
  resolve: the operator vouches for them. Else any host whose every address is public: loopback,
  private, link-local, shared, multicast, reserved and unspecified addresses are refused. A name is
  resolved once and the connection goes to the address checked (no second lookup to rebind); every
  redirect is checked again, at most MAX_REDIRECTS of them.
- Time: one deadline for the whole download, counted from the request (FETCH_DEADLINE_S), however
  the upstream trickles its bytes; the fetches run on a small pool of their own (FETCH_THREADS), so
  slow or silent hosts never hold the threads text requests use.
- Errors: in the client's terms (not allowed, too slow, too large, could not be fetched), never
  the upstream's status, errno or address.
"""

from __future__ import annotations

import asyncio
import http.client
import ipaddress
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from .checks import RequestError

FETCH_DEADLINE_S = 10.0  # seconds for all of a request's images, from its arrival
FETCH_THREADS = 4  # downloads at once, across requests
MAX_FETCHED = 4 * 1024 * 1024  # bytes of a fetched image: as much as a request's body may hold (guard.MAX_BODY)
MAX_REDIRECTS = 3
_REDIRECTS = {301, 302, 303, 307, 308}
_CHUNK = 64 * 1024


def refuse_urls(conversation: list[dict], param: str) -> None:
    """RequestError where a message names a remote image: this server fetches none."""
    for url in remote_urls(conversation):
        raise RequestError(
            f"this server does not fetch image URLs ({url[:60]}): send the image itself as a data: URL "
            "(data:image/png;base64,...), or start the server with --allow-image-urls",
            param,
            code="image_url_not_allowed",
        )


def remote_urls(conversation: list[dict]) -> list[str]:
    return [part["url"] for message in conversation for part in _parts(message) if _is_remote(part)]


def _parts(message: dict) -> list:
    content = message.get("content")
    return content if isinstance(content, list) else []


def _is_remote(part) -> bool:
    """An image part that names a URL to fetch (images.image_part's {"type": "image", "url": ...})."""
    return isinstance(part, dict) and "url" in part


class ImageFetcher:
    """Fetches the remote images of a conversation by the rules above. `domains`: the hosts allowed
    (empty: any public one)."""

    def __init__(self, domains: tuple[str, ...] = (), deadline_s: float = FETCH_DEADLINE_S, threads: int = FETCH_THREADS):
        self.domains = tuple(d.lower().strip().strip(".") for d in domains if d.strip())
        self.deadline_s = deadline_s
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="edgeinfer-image-url")

    async def fetched(self, conversation: list[dict], param: str) -> list[dict]:
        """The conversation with each remote image part replaced by its data; RequestError naming
        `param` for one that is not allowed or does not arrive whole within the deadline."""
        urls = remote_urls(conversation)
        if not urls:
            return conversation
        deadline = time.monotonic() + self.deadline_s
        loop = asyncio.get_running_loop()
        got = await asyncio.gather(*(loop.run_in_executor(self.pool, self.fetch, url, deadline, param) for url in urls))
        images = iter(got)
        return [
            {**m, "content": [next(images) if _is_remote(p) else p for p in m["content"]]} if _parts(m) else m for m in conversation
        ]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def fetch(self, url: str, deadline: float, param: str) -> dict:
        """The SDK's image part of the image at `url`, redirects followed and each checked."""
        refuse = _Refusals(url[:60], param, self)
        for _ in range(MAX_REDIRECTS + 1):
            status, headers, data = self._get(url, deadline, refuse)
            if status in _REDIRECTS and headers.get("location"):
                url = urllib.parse.urljoin(url, headers["location"])
                continue
            if status != 200:
                raise refuse.unfetched()
            media_type = headers.get("content-type", "").split(";")[0].strip().lower()
            return {"type": "image", "image": data, "media_type": media_type if media_type.startswith("image/") else None}
        raise refuse.unfetched(f"it redirects more than {MAX_REDIRECTS} times")

    def _get(self, url: str, deadline: float, refuse: _Refusals) -> tuple[int, dict, bytes]:
        """(status, headers by lower-case name, body) of one GET, within `deadline`."""
        if time.monotonic() >= deadline:  # waited for a thread of the pool past it
            raise refuse.too_slow()
        target = urllib.parse.urlsplit(url)
        if target.scheme not in ("http", "https") or not target.hostname:
            raise refuse.not_allowed()
        try:
            port = target.port or (443 if target.scheme == "https" else 80)
        except ValueError:
            raise refuse.not_allowed() from None
        address = self._address(target.hostname, port, refuse)
        connection = _connection(target.scheme, target.hostname, port, address, max(0.01, deadline - time.monotonic()))
        timer = _Deadline(connection, deadline)
        try:
            path = (target.path or "/") + (f"?{target.query}" if target.query else "")
            connection.request("GET", path, headers={"User-Agent": "edgeinfer", "Accept": "image/*"})
            response = connection.getresponse()
            headers = {k.lower(): v for k, v in response.getheaders()}
            if response.status != 200:
                return response.status, headers, b""
            if int(headers.get("content-length") or 0) > MAX_FETCHED:
                raise refuse.too_large()
            data = _body(response, refuse)
        except (OSError, http.client.HTTPException, ValueError):  # the deadline's timer closed the socket, or the host failed
            raise (refuse.too_slow() if timer.expired or time.monotonic() >= deadline else refuse.unfetched()) from None
        finally:
            timer.cancel()
            connection.close()
        if timer.expired:
            raise refuse.too_slow()
        return response.status, headers, data

    def _address(self, host: str, port: int, refuse: _Refusals) -> str:
        """The address to connect to: `host` resolved, where the rules allow it."""
        named = bool(self.domains) and _named(host.lower().strip("."), self.domains)
        if self.domains and not named:
            raise refuse.not_allowed()
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise refuse.unfetched() from None
        addresses = [entry[4][0] for entry in found]
        if not addresses or not (named or all(is_public(a) for a in addresses)):
            raise refuse.not_allowed()
        return addresses[0]


def is_public(address: str) -> bool:
    """Whether an IP address is one of the public internet's (not loopback, private, link-local,
    shared, multicast, reserved or unspecified); an IPv4 address mapped into IPv6 as itself."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_link_local or ip.is_loopback)


def _named(host: str, domains: tuple[str, ...]) -> bool:
    return any(host == d or host.endswith("." + d) for d in domains)


def _connection(scheme: str, host: str, port: int, address: str, timeout: float) -> http.client.HTTPConnection:
    """A connection for `host` (its Host header, its TLS name) that connects to `address`, the one checked."""
    kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    connection = kind(host, port, timeout=timeout)
    connection._create_connection = lambda _, timeout=None, source=None: socket.create_connection((address, port), timeout, source)
    return connection


def _body(response: http.client.HTTPResponse, refuse: _Refusals) -> bytes:
    chunks, size = [], 0
    while chunk := response.read(_CHUNK):
        size += len(chunk)
        if size > MAX_FETCHED:
            raise refuse.too_large()
        chunks.append(chunk)
    return b"".join(chunks)


class _Deadline:
    """Closes a connection's socket at `deadline`, which ends any read it is blocked in: a host that
    trickles its bytes cannot hold the fetch past it."""

    def __init__(self, connection: http.client.HTTPConnection, deadline: float):
        self.connection, self.expired = connection, False
        self.timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._expire)
        self.timer.daemon = True
        self.timer.start()

    def _expire(self) -> None:
        self.expired = True
        sock = self.connection.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed
                pass

    def cancel(self) -> None:
        self.timer.cancel()


class _Refusals:
    """The errors of one image URL, in the client's terms."""

    def __init__(self, where: str, param: str, fetcher: ImageFetcher):
        self.where, self.param, self.fetcher = where, param, fetcher

    def not_allowed(self) -> RequestError:
        hosts = "the hosts it was told to allow" if self.fetcher.domains else "public addresses"
        return RequestError(
            f"the image URL {self.where} is not allowed: this server fetches images only from {hosts}; "
            "send the image itself as a data: URL",
            self.param,
            code="image_url_not_allowed",
        )

    def too_slow(self) -> RequestError:
        return RequestError(
            f"the image at {self.where} did not arrive within {self.fetcher.deadline_s:g} s: send the image itself as a data: URL",
            self.param,
            code="image_url_timeout",
        )

    def too_large(self) -> RequestError:
        return RequestError(
            f"the image at {self.where} is over {MAX_FETCHED} bytes: send a smaller one", self.param, code="image_too_large"
        )

    def unfetched(self, why: str = "") -> RequestError:
        return RequestError(
            f"the image at {self.where} could not be fetched{f' ({why})' if why else ''}: check the URL, or send the image "
            "itself as a data: URL",
            self.param,
            code="image_url_unreachable",
        )
