"""Continuous batching: many callers, one engine, one step loop.

Callers in any thread `submit` a prompt and iterate the `Request` they get back. A request joins
the running batch at the next step and leaves it when it ends, so a short request never waits for
a long one; an idle scheduler sleeps. Each step admits waiting requests into free rows of the KV
pool (kv_cache.SlotPool), prefills one chunk of one new prompt (alone in its row), then decodes one
token for every row past its prefill, in one pass; a row with speculative decoding checks its
proposed tokens in a pass of its own. Exports whose attention does not write its cache in place
(`kv.in_place` false) are served one request at a time.

    scheduler = Scheduler(engine, max_batch=8)
    request = scheduler.submit("The capital of France is", max_new_tokens=16)   # from any thread
    for piece in request: ...                # or request.result()
    scheduler.close()
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .errors import BusyError, ConstraintError
from .kv_cache import SlotPool
from .memory import check_generation
from .runtime import GenerationBindings
from .sequence import GenerationResult, Piece, Sequence
from .settings import GenerationConfig

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


@dataclass
class _Row:
    """A request being served: its Sequence, its row of the pool and how far its prefill got."""

    request: Request
    sequence: Sequence
    is_greedy: bool
    slot: int = -1
    prefilled: int = 0
    is_restored: bool = False  # the prefix cache was looked up
    token: int = 0  # the newest token, fed to the next decode pass (set when the prefill ends)
    events: Iterator | None = field(default=None, repr=False)  # one-at-a-time serving: the engine's own loop

    @property
    def is_decoding(self) -> bool:
        return self.prefilled == len(self.sequence.prompt_ids)


class Scheduler:
    """Continuous batching over one engine, for callers in many threads (see the module's text).
    `max_batch` rows are allocated once, each of the engine's `max_context` tokens, within its
    memory plan; `max_queue` requests may wait for a row before `submit` raises BusyError."""

    def __init__(self, engine, max_batch: int = 8, max_queue: int = 64):
        self.engine, self.max_batch, self.max_queue = engine, max_batch, max_queue
        # A decode graph of fixed shapes (split layout, --static-context) takes one token a pass on
        # a cache of its own capacity: requests then run one at a time through the engine's loop.
        self.is_batched = engine.manifest.kv.in_place and not engine.static
        self.pool = None
        if self.is_batched:
            check_generation(engine.memory, max_batch, engine.max_context, engine.provider, engine._memory_limit)
            shapes = {name: engine.graph.inputs[name].shape for name in engine.manifest.kv.past}
            prefix = engine.prefix_cache if engine.provider == "cpu" or engine.row_copy else None
            self.pool = SlotPool(engine.manifest.kv, shapes, max_batch, engine.max_context, engine.graph.allocate,
                                 prefix, engine.graph, engine.row_copy)
        self._bindings: dict[int, GenerationBindings] = {}  # decode passes, by their number of rows
        self._speculation_bindings = GenerationBindings()  # each row's own passes (speculative decoding)
        self._waiting: deque[_Row] = deque()
        self._rows: list[_Row] = []
        self._wake = threading.Condition()
        self._closing = False  # no new requests
        self._stopping = False  # end the running ones now
        self._thread = threading.Thread(target=self._run, name="edgeinfer-scheduler", daemon=True)
        self._thread.start()

    @property
    def mode(self) -> str:
        if self.is_batched:
            return f"continuous batching of up to {self.max_batch} rows"
        if self.engine.static:
            return "one request at a time (this export's decode graph has fixed shapes: --static-context)"
        return "one request at a time (this export's attention does not write its cache in place)"

    def submit(self, prompt, config: GenerationConfig | None = None, **settings) -> Request:
        """Queue a generation; bad settings or prompts raise here, in the caller's thread."""
        (sequence,), is_greedy = self.engine._sequences([prompt], config, settings)
        request = Request(self)
        row = _Row(request, sequence, is_greedy)
        if not self.is_batched:
            row.events = self.engine._generate([sequence], is_greedy)
        with self._wake:
            if self._closing:
                raise BusyError("the scheduler is shutting down and takes no new requests")
            waiting = len(self._waiting) - self._free_rows()  # those that just came in take the free rows at the next step
            if waiting >= self.max_queue:
                raise BusyError(f"{waiting} requests are already waiting (max_queue {self.max_queue}): retry later")
            self._waiting.append(row)
            self._wake.notify()
        return request

    def _free_rows(self) -> int:
        return self.pool.free_slots if self.is_batched else int(not self._rows)

    @property
    def is_alive(self) -> bool:
        """Whether the step loop runs (it stops only once closed)."""
        return self._thread.is_alive()

    @property
    def running(self) -> int:
        return len(self._rows)

    @property
    def waiting(self) -> int:
        """Requests waiting for a row (not those about to take a free one)."""
        return max(0, len(self._waiting) - self._free_rows())

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
                while not (self._waiting or self._rows or self._closing):
                    self._wake.wait()
                if self._stopping or (self._closing and not (self._waiting or self._rows)):
                    break
            self._drop_cancelled()
            with self._wake:
                self._admit()
            try:
                self._step()
            except Exception as error:  # noqa: BLE001 - the loop must outlive any step: its rows get the error
                for row in list(self._rows):
                    self._end(row, error)
        for row in [*self._rows, *self._waiting]:
            self._end(row, row.sequence.finish("length"))
        self._waiting.clear()

    def _admit(self) -> None:
        while self._waiting and self._free_rows():
            row = self._waiting.popleft()
            row.slot = self.pool.acquire() if self.is_batched else 0
            self._rows.append(row)

    def _drop_cancelled(self) -> None:
        """Requests whose caller cancelled them: running ones free their row, waiting ones leave the queue."""
        for row in [r for r in self._rows if r.request.cancelled]:
            self._end(row, _END)
        with self._wake:
            gone = [r for r in self._waiting if r.request.cancelled]
            for row in gone:
                self._waiting.remove(row)
        for row in gone:
            self._end(row, _END)

    def _step(self) -> None:
        if not self.is_batched:
            self._step_alone()
            return
        prefilling = next((row for row in self._rows if not row.is_decoding), None)
        if prefilling is not None:
            self._prefill_chunk(prefilling)
        decoding = [row for row in self._rows if row.is_decoding and not row.sequence.speculation]
        if decoding:
            self._decode(decoding)
        for row in [row for row in self._rows if row.is_decoding and row.sequence.speculation]:
            self._speculate(row)

    def _speculate(self, row: _Row) -> None:
        """A row with speculative decoding proposes and checks its tokens in a pass of its own
        (the engine's step, on the pool's row)."""
        try:
            for piece in self.engine.speculate(row.slot, row.sequence, self.pool, self._speculation_bindings):
                row.request._put(piece)
        except ConstraintError as error:
            self._end(row, error)
            return
        if row.sequence.is_done:
            self._end(row, _END)

    def _prefill_chunk(self, row: _Row) -> None:
        ids = row.sequence.prompt_ids
        if not row.is_restored:  # at its first chunk, not at admission: a prompt admitted beside one that
            row.is_restored = True  # starts the same way (n choices) finds that one's blocks stored by then
            row.prefilled = row.sequence.cached = self.pool.restore(row.slot, ids)
        end = min(row.prefilled + self.engine.prefill_chunk, len(ids))
        inputs = self.pool.prefill_inputs(row.slot, ids, row.prefilled, end)
        logits = self.engine.graph.run_rows(inputs, self.pool.pooled, row.slot, 1)
        row.prefilled = end
        if row.is_decoding:
            self.pool.store(row.slot, ids)
            token = self._choose(logits, [row], [0])[0]
            self._add(row, token)

    def _decode(self, rows: list[_Row]) -> None:
        count = max(row.slot for row in rows) + 1
        inputs = self.pool.decode_inputs(count, {row.slot: row.token for row in rows})
        kept = self._decode_bindings(count)
        kept.graph.run(inputs)
        for row, token in zip(rows, self._choose(kept.logits, rows, [row.slot for row in rows], kept)):
            self._add(row, token)

    def _decode_bindings(self, rows: int) -> GenerationBindings:
        """What a decode pass over the first `rows` rows keeps bound from one step to the next
        (the pool's rows and one logits value), made at the first such pass."""
        if rows not in self._bindings:
            graph = self.engine.graph
            logits = graph.allocate_output("logits", [rows, 1, self.engine.manifest.vocab_size])
            self._bindings[rows] = GenerationBindings(graph.bind_rows(self.pool.pooled, 0, rows, logits), logits)
        return self._bindings[rows]

    def _choose(self, logits, rows: list[_Row], positions: list[int], kept: GenerationBindings | None = None) -> list[int]:
        """Each row's next token, from the logits of the pass at its position."""
        if all(row.is_greedy for row in rows):
            ids = self.engine.heads.argmax(logits, kept)
            return [ids[position] for position in positions]
        last = self.engine.heads.last(logits)
        return [self._choose_one(row, last[position]) for row, position in zip(rows, positions)]

    def _choose_one(self, row: _Row, logits) -> int | None:
        """A row's next token, or None where its constraint reached a dead end (the row ends with
        that error; the others go on)."""
        try:
            return row.sequence.choose(logits)
        except ConstraintError as error:
            self._end(row, error)
            return None

    def _add(self, row: _Row, token: int | None) -> None:
        if token is None:  # ended already (_choose_one)
            return
        try:
            piece = row.sequence.add(token)
        except ConstraintError as error:
            self._end(row, error)
            return
        row.token = token
        if piece is not None:
            row.request._put(piece)
        if row.sequence.is_done:
            self._end(row, _END)

    def _step_alone(self) -> None:
        row = self._rows[0]
        try:
            _, piece = next(row.events)
            row.request._put(piece)
        except StopIteration:
            self._end(row, _END)

    def _end(self, row: _Row, last) -> None:
        """Free the request's row, then give it its last item (a final piece, an error, or nothing
        more): a caller that sees its request end no longer counts it as running."""
        if row in self._rows:
            self._rows.remove(row)
            if self.is_batched:
                self.pool.release(row.slot)
            elif row.events is not None:
                row.events.close()
        if last is not _END:
            row.request._put(last)
        row.request._put(_END)
