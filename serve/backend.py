"""What the app serves from: a Backend (the SDK's Scheduler, or replicas.Replicas in front of Ray
Serve replicas), and the two async helpers both the app and the replicas use to submit requests
and read their pieces without blocking the event loop."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from edgeinfer.sdk.errors import BusyError

from edgeinfer.sdk.manifest import Manifest
from edgeinfer.sdk.tokenizer import Tokenizer


class Submitted(Protocol):
    """A request a backend has taken. One may carry `response_headers` (a dict added to its HTTP
    response: the replica that serves it); a scheduler's Request has none."""

    def forward(self, deliver: Callable) -> None:
        """Hand each item (a Piece, an error, None after the last) to `deliver`, on another thread."""

    def cancel(self) -> None: ...


class Backend(Protocol):
    """What the app needs of whatever runs the requests."""

    mode: str  # how requests are served, in words (/health, the log)
    manifest: Manifest
    tokenizer: Tokenizer
    max_context: int

    def submit(self, prompt, **settings) -> Submitted:
        """Take a request (token ids and generation settings); raises the EdgeInferError that refuses it."""

    def close(self, grace: float | None = None) -> None:
        """Take no new requests; give running ones `grace` seconds."""

    def stats(self) -> dict[str, float]:
        """Figures for /metrics (queue, running rows, prefix cache), by name; none where the backend has none."""


async def submit_all(backend: Backend, work: Callable[[], list[tuple[list[int], dict]]]) -> list:
    """Each (prompt ids, settings) that `work` gives submitted, `work` and all on a worker thread:
    rendering, encoding and compiling a constraint take time the event loop must not wait for.
    Where one is refused, the others are cancelled; a request whose client went away meanwhile is
    cancelled once it exists."""

    def submit_all() -> list:
        made = []
        try:
            for ids, settings in work():
                made.append(backend.submit(ids, **settings))
        except BaseException:
            for request in made:
                request.cancel()
            raise
        return made

    submitted = asyncio.get_running_loop().run_in_executor(None, submit_all)
    try:
        return await asyncio.shield(submitted)
    except asyncio.CancelledError:
        submitted.add_done_callback(lambda done: done.exception() is None and [r.cancel() for r in done.result()])
        raise


async def pieces(requests: list) -> AsyncIterator:
    """(index, piece) of the requests' pieces as they come, awaited on the event loop (a
    cancelled await, a client gone, returns at once; a thread blocked on a request's own queue
    could not be cancelled). An error of any request is raised."""
    loop, arrived = asyncio.get_running_loop(), asyncio.Queue()
    for index, request in enumerate(requests):
        request.forward(lambda item, i=index: loop.call_soon_threadsafe(arrived.put_nowait, (i, item)))
    left = len(requests)
    while left:
        index, item = await arrived.get()
        if item is None:
            left -= 1
        elif isinstance(item, BaseException):
            raise item
        else:
            yield index, item


EMBEDDING_QUEUE = 16  # embedding requests admitted at once (one running, the rest waiting)


class EmbeddingWork:
    """Embedding requests run on a thread of their own, one at a time, apart from the worker
    threads every route uses to parse and render (a large embedding on those made a one-token chat
    wait seconds): at most `size` admitted, running or waiting (more are a 429), and each stopped
    between its batches once its client goes away."""

    def __init__(self, size: int = EMBEDDING_QUEUE):
        self.size, self.admitted, self.cancelled = size, 0, 0
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="edgeinfer-embed")

    async def run(self, embed: Callable, gone: Callable[[], Awaitable]):
        """`embed(stop=Event)`'s result, or None once `gone()` returns first (the client left: the
        work stops at its next batch, and counts as admitted until it has)."""
        if self.admitted >= self.size:
            raise BusyError(f"{self.admitted} embedding requests are running or waiting, the most this server takes: retry shortly")
        self.admitted += 1
        stop = threading.Event()
        work = asyncio.get_running_loop().run_in_executor(self._thread, functools.partial(embed, stop=stop))
        work.add_done_callback(self._ended)
        left = asyncio.ensure_future(gone())
        await asyncio.wait({work, left}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            left.cancel()
            return work.result()
        stop.set()
        self.cancelled += 1
        work.add_done_callback(lambda done: done.exception())  # its CancelledRequestError is nobody's to read
        return None

    def _ended(self, _) -> None:
        self.admitted -= 1

    def stats(self) -> dict[str, float]:
        return {"embedding_requests": self.admitted, "embedding_cancelled": self.cancelled}

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
