"""What the app serves from: a Backend (the SDK's Scheduler, or replicas.Replicas in front of Ray
Serve replicas), and the two async helpers both the app and the replicas use to submit requests
and read their pieces without blocking the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from edgeinfer.sdk.manifest import Manifest
from edgeinfer.sdk.tokenizer import Tokenizer


class Submitted(Protocol):
    """A request a backend has taken."""

    response_headers: dict[str, str]  # added to its HTTP response

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


async def submit_all(backend: Backend, prompt_ids: Callable, choices: list[dict]) -> list:
    """Every choice of every prompt submitted, on a worker thread: rendering, encoding and
    compiling a constraint take time the event loop must not wait for. Where one is refused, the
    others are cancelled; a request whose client went away meanwhile is cancelled once it exists."""

    def submit_all() -> list:
        made = []
        try:
            for ids in prompt_ids():
                made += [backend.submit(ids, **settings) for settings in choices]
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
