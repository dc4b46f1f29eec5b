"""Continuous batching: many callers, one engine, one step loop.

Callers in any thread `submit` a prompt and iterate the `Request` they get back. A request joins
the running batch at the next step and leaves it when it ends, so a short request never waits for
a long one; an idle scheduler sleeps. Each request is a Slot whose state goes waiting →
prefilling → decoding → done. Each step admits waiting slots into free rows of one KV cache
(kv_cache.SlotCache), prefills one chunk of one prompt (alone in its row), then decodes one token
for every decoding row in one pass; a row with speculative decoding takes a step of its own. The
runner (runner.py) runs every pass. Exports whose rows cannot be at different steps
(`runner.batches_continuously` false) are served one request at a time, through the engine's loop.

    scheduler = Scheduler(engine, max_batch=8)
    request = scheduler.submit("The capital of France is", max_new_tokens=16)   # from any thread
    for piece in request: ...                # or request.result()
    scheduler.close()
"""

from __future__ import annotations

import enum
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .errors import BusyError
from .generation import add_chosen, decode_step
from .sequence import GenerationResult, Piece, Sequence
from .settings import GenerationConfig
from .speculative import step

_END = object()  # what a request's queue gets after its last piece


class Request:
    """One submitted generation. Iterate it for its pieces (the last has `finish_reason` and the
    timings), or call `result()`; an error of the step loop is raised here. `cancel()` ends it at
    the next step and frees its row (or takes it out of the queue). An event loop that must not
    block a thread on the iteration can `forward` the items to a callback instead."""

    def __init__(self, scheduler: Scheduler):
        self._scheduler, self._pieces = scheduler, queue.Queue()
        self._lock, self._deliver = threading.Lock(), self._pieces.put
        self.cancelled = False

    def forward(self, deliver: Callable[[Piece | BaseException | None], None]) -> None:
        """From now on, hand each item to `deliver` (on the scheduler's thread) instead of the
        iteration, after those already waiting: a Piece, an error, or None after the last."""
        with self._lock:
            while not self._pieces.empty():
                item = self._pieces.get_nowait()
                deliver(None if item is _END else item)
            self._deliver = lambda item: deliver(None if item is _END else item)

    def _put(self, item) -> None:
        with self._lock:
            self._deliver(item)

    def __iter__(self) -> Iterator[Piece]:
        while (item := self._pieces.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item

    def result(self) -> GenerationResult:
        return GenerationResult.from_pieces(list(self))

    def cancel(self) -> None:
        self.cancelled = True
        self._scheduler._wake_up()


class State(enum.Enum):
    WAITING = "waiting"  # queued for a row
    PREFILLING = "prefilling"  # in a row, its prompt going in chunk by chunk
    DECODING = "decoding"  # one token a step
    DONE = "done"


@dataclass
class Slot:
    """A request being served: its Sequence, its state, its row of the cache and how many of its
    prompt's tokens the cache holds."""

    request: Request
    sequence: Sequence
    state: State = State.WAITING
    row: int = -1
    num_prefilled: int = 0
    pictures: tuple = ()  # a chat turn's pictures, held in the engine's store until the request ends
    events: Iterator | None = field(default=None, repr=False)  # one-at-a-time serving: the engine's own loop


class Scheduler:
    """Continuous batching over one engine, for callers in many threads (see the module's text).
    `max_batch` rows are allocated once, each of the engine's `max_context` tokens, within its
    memory plan; `max_queue` requests may wait for a row before `submit` raises BusyError. It
    uses the engine's public parts alone: `runner`, `prepare`, `run`, `check_memory`."""

    def __init__(self, engine, max_batch: int = 8, max_queue: int = 64):
        self.engine, self.runner, self.max_batch, self.max_queue = engine, engine.runner, max_batch, max_queue
        self.is_batched = self.runner.batches_continuously
        self.batch = None
        if self.is_batched:
            engine.check_memory(max_batch, engine.max_context)
            self.batch = self.runner.new_batch(max_batch, engine.max_context, reuses_logits=True)
        self._waiting: deque[Slot] = deque()
        self._slots: list[Slot] = []  # those holding a row
        self._wake = threading.Condition()
        self._closing = False  # no new requests
        self._stopping = False  # end the running ones now
        self._thread = threading.Thread(target=self._run, name="edgeinfer-scheduler", daemon=True)
        self._thread.start()

    @property
    def mode(self) -> str:
        if self.is_batched:
            return f"continuous batching of up to {self.max_batch} rows"
        if self.runner.is_static:
            return "one request at a time (this export's decode graph has fixed shapes: --static-context)"
        return "one request at a time (this export's attention does not write its cache in place)"

    # What a server needs besides `submit` and `close` (serve/backend.py's Backend).

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def manifest(self):
        return self.engine.manifest

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def stats(self) -> dict[str, float]:
        """The queue, the running rows and the prefix cache's counts, by name."""
        cache = self.engine.prefix_cache
        return {
            "queue_length": self.waiting,
            "running_rows": self.running,
            "prefix_cache_hit_tokens": cache.hit_tokens,
            "prefix_cache_miss_tokens": cache.missed_tokens,
            "prefix_cache_bytes": cache.num_bytes,
        }

    def submit(self, prompt, config: GenerationConfig | None = None, pictures=(), **settings) -> Request:
        """Queue a generation; bad settings or prompts raise here, in the caller's thread. A chat
        turn's `pictures` (ChatTurn.pictures) are encoded here too, in the caller's thread, beside
        the step loop's passes, and held in the engine's store until the request ends."""
        if not pictures:
            return self._queued(prompt, config, (), settings)
        self.engine.runner.see(pictures)
        try:
            return self._queued(prompt, config, tuple(pictures), settings)
        except BaseException:  # refused: nothing will let them go at its end
            self.engine.runner.let_go(pictures)
            raise

    def _queued(self, prompt, config: GenerationConfig | None, pictures: tuple, settings: dict) -> Request:
        (sequence,) = self.engine.prepare([prompt], config, **settings)
        slot = Slot(Request(self), sequence, pictures=pictures)
        if not self.is_batched:
            slot.events = self.engine.run([sequence])
        with self._wake:
            if self._closing:
                raise BusyError("the scheduler is shutting down and takes no new requests")
            num_waiting = len(self._waiting) - self.num_free_rows  # those that just came in take the free rows
            if num_waiting >= self.max_queue:
                raise BusyError(f"{num_waiting} requests are already waiting (max_queue {self.max_queue}): retry later")
            self._waiting.append(slot)
            self._wake.notify()
        return slot.request

    @property
    def num_free_rows(self) -> int:
        """Rows of the cache no request holds."""
        return self.batch.cache.num_free if self.is_batched else int(not self._slots)

    @property
    def is_alive(self) -> bool:
        """Whether the step loop runs (it stops only once closed)."""
        return self._thread.is_alive()

    @property
    def running(self) -> int:
        return len(self._slots)

    @property
    def waiting(self) -> int:
        """Requests waiting for a row (not those about to take a free one)."""
        return max(0, len(self._waiting) - self.num_free_rows)

    @property
    def is_idle(self) -> bool:
        """No request running, and none waiting (about to take a free row included)."""
        with self._wake:
            return not self._slots and not self._waiting

    def close(self, grace: float | None = None) -> None:
        """Take no new requests; let the others end within `grace` seconds (None: however long
        they take), then end those still running with finish reason "length", and stop."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(grace)
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # The step loop, on its own thread.

    def _wake_up(self) -> None:
        with self._wake:
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._waiting or self._slots or self._closing):
                    self._wake.wait()
                if self._stopping or (self._closing and not (self._waiting or self._slots)):
                    break
            self._drop_cancelled()
            with self._wake:
                self._admit()
            try:
                self._step()
            except Exception as error:  # noqa: BLE001 - the loop must outlive any step: its slots get the error
                for slot in list(self._slots):
                    self._end(slot, error)
        for slot in [*self._slots, *self._waiting]:
            self._end(slot, slot.sequence.finish("length"))
        self._waiting.clear()

    def _admit(self) -> None:
        while self._waiting and self.num_free_rows:
            slot = self._waiting.popleft()
            slot.row = self.batch.cache.acquire() if self.is_batched else 0
            slot.state = State.PREFILLING
            self._slots.append(slot)
            if self.is_batched:
                try:
                    self.runner.assign(self.batch, slot.row, slot.sequence.adapter)
                except Exception as error:  # noqa: BLE001 - the loop must outlive it: the request gets the error
                    self._end(slot, error)

    def _drop_cancelled(self) -> None:
        """Requests whose caller cancelled them: running ones free their row, waiting ones leave the queue."""
        for slot in [s for s in self._slots if s.request.cancelled]:
            self._end(slot, _END)
        with self._wake:
            gone = [s for s in self._waiting if s.request.cancelled]
            for slot in gone:
                self._waiting.remove(slot)
        for slot in gone:
            self._end(slot, _END)

    def _step(self) -> None:
        """The step plan: one prefill chunk, one decode pass over the decoding rows, then each
        speculative row's own step."""
        if not self.is_batched:
            self._step_alone()
            return
        prefilling = next((s for s in self._slots if s.state is State.PREFILLING), None)
        if prefilling is not None:
            self._prefill(prefilling)
        decoding = [s for s in self._slots if s.state is State.DECODING and not s.sequence.speculation]
        if decoding:
            self._decode(decoding)
        for slot in [s for s in self._slots if s.state is State.DECODING and s.sequence.speculation]:
            self._speculate(slot)

    def _prefill(self, slot: Slot) -> None:
        ids = slot.sequence.prompt_ids
        if slot.num_prefilled == 0:  # at its first chunk, not at admission: a prompt admitted beside one that
            # starts the same way (n choices) finds that one's blocks stored by then
            slot.num_prefilled = slot.sequence.num_cached = self.runner.restore(self.batch, slot.row, ids)
        end = min(slot.num_prefilled + self.engine.prefill_chunk, len(ids))
        logits = self.runner.prefill_span(self.batch, slot.row, ids, slot.num_prefilled, end)
        slot.num_prefilled = end
        if end == len(ids) or self.batch.cache.evicts:  # a window evicts: its blocks are kept while it holds them
            self.runner.store(self.batch, slot.row, ids[:end])
        if end == len(ids):
            slot.state = State.DECODING
            self._deliver([slot], add_chosen(self.runner.choose(logits, [slot.sequence], [0]), {slot.row: slot.sequence}))

    def _decode(self, slots: list[Slot]) -> None:
        self._deliver(slots, decode_step(self.runner, self.batch, {s.row: s.sequence for s in slots}))

    def _speculate(self, slot: Slot) -> None:
        self._deliver([slot], ((slot.row, piece) for piece in step(self.runner, self.batch, slot.row, slot.sequence)))

    def _deliver(self, slots: list[Slot], pieces: Iterator[tuple[int, Piece]]) -> None:
        """Each (row, piece) of the step loop (run to its end first: a row is freed only once its
        passes are done) to its slot's request; a slot leaves after its last piece (the one with a
        finish reason), and one that failed alone (a constraint's dead end) gives its request the error."""
        by_row = {slot.row: slot for slot in slots}
        for row, piece in list(pieces):
            slot = by_row[row]
            if piece.error is not None:
                self._end(slot, piece.error)
                continue
            slot.request._put(piece)
            if piece.finish_reason is not None:
                self._end(slot, _END)

    def _step_alone(self) -> None:
        slot = self._slots[0]
        try:
            pieces = [next(slot.events)]
        except StopIteration:
            self._end(slot, _END)
            return
        self._deliver([slot], iter(pieces))

    def _end(self, slot: Slot, last) -> None:
        """Free the slot's row, then give its request the last item (a final piece, an error, or
        nothing more): a caller that sees its request end no longer counts it as running."""
        if slot in self._slots:
            self._slots.remove(slot)
            if self.is_batched:
                self.batch.cache.release(slot.row)
            elif slot.events is not None:
                slot.events.close()
        slot.state = State.DONE
        if slot.pictures:
            self.runner.let_go(slot.pictures)
        if last is not _END:
            slot.request._put(last)
        slot.request._put(_END)
