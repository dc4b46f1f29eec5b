"""Several exports served from one memory budget, each by its own Scheduler.

A model is loaded when it is first asked for (`ModelPool.use`). Before a load, the pool works out
what the model will hold (its memory plan: weights, KV cache, prefix cache) and, where that would
pass `memory_limit`, unloads the least recently used idle models until it fits. Idle means no
request running or waiting on it and no caller between `use` and its submit; models serving
requests are never unloaded, so a load never cuts a running request: where only busy models
hold the memory, the load is refused with BusyError (retry later). A model that would not fit
even alone is refused with the figures, and nothing is unloaded for a load that is then refused.
Idle models are unloaded `keep_alive` seconds after their last use (0: as soon as they are idle;
None: never); pinned models stay loaded. An unloaded model keeps nothing: its tokenizer goes with
its engine, and the plan counts it.

Each load reads the folder whole as it is then, its small files (manifest, tokenizer, template,
graphs) checked against the manifest's SHA-256, so a folder replaced while the pool runs (a new
export) is served whole and new, never with the old tokenizer. A folder that is missing or damaged
makes its model unavailable (UnavailableError, naming the model and the reason; `status` says it),
and the other models serve on; the next request for it tries the load again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .embedder import Embedder
from .engine import Engine, serving_context
from .errors import BusyError, EdgeInferError, ModelNotFoundError, SettingsError, UnavailableError
from .manifest import load_manifest, verify_files
from .memory import MemoryPlan, give_back_freed_memory, size_text, tokenizer_bytes
from .scheduler import Scheduler

DEFAULT_KEEP_ALIVE_S = 300.0
VERIFIED_FILE_BYTES = 64 * 2**20  # a load checks the SHA-256 of every file up to this size (not the weights)


@dataclass
class _Model:
    """One model's books: its scheduler while loaded, the bytes it holds or is being loaded
    into, callers between `use` and their submit, and its load history."""

    name: str
    folder: Path
    pinned: bool = False
    scheduler: Scheduler | None = None
    held: int = 0
    users: int = 0
    last_used: float = 0.0
    loads: int = 0
    load_seconds: float = 0.0
    error: str | None = None  # why its last load failed; None once one succeeds
    loading: threading.Lock = field(default_factory=threading.Lock)

    @property
    def idle(self) -> bool:
        return self.users == 0 and (self.scheduler is None or self.scheduler.is_idle)


class ModelPool:
    """Models by name (`models`: name -> export folder), loaded on demand within `memory_limit`
    bytes (None: no limit but what each load checks against free memory): each by `Engine.load`
    with `engine_options` (provider, threads, max_context, prefix_cache in MiB) and a Scheduler of
    `max_batch` rows and `max_queue` waiting requests. `pin` names models never unloaded. `on_event` is told of
    each load and unload, in words (a server logs them)."""

    def __init__(
        self,
        models: dict[str, str | Path],
        memory_limit: int | None = None,
        keep_alive: float | None = DEFAULT_KEEP_ALIVE_S,
        pin: tuple[str, ...] = (),
        max_batch: int = 8,
        max_queue: int = 64,
        on_event: Callable[[str], None] = lambda message: None,
        **engine_options,
    ):
        if not models:
            raise SettingsError("a model pool needs at least one model")
        if keep_alive is not None and keep_alive < 0:
            raise SettingsError(f"keep_alive must be seconds of at least 0, or None for never, got {keep_alive!r}", "keep_alive")
        unknown = [name for name in pin if name not in models]
        if unknown:
            raise ModelNotFoundError(f"cannot pin {', '.join(unknown)}: the models are {', '.join(models)}")
        self.memory_limit, self.keep_alive, self._say = memory_limit, keep_alive, on_event
        self._models = {name: _Model(name, Path(folder), name in pin) for name, folder in models.items()}
        self._lock = threading.Lock()
        self._unloads = 0
        # no prefix cache unless asked for, so that the plan a load is checked by is what it holds
        self._engine = {**engine_options, "max_batch": max_batch, "prefix_cache": engine_options.get("prefix_cache") or 0}
        self._max_queue = max_queue
        self._stop = threading.Event()
        if keep_alive is not None:
            threading.Thread(target=self._reap, name="edgeinfer-pool-keep-alive", daemon=True).start()

    @property
    def names(self) -> list[str]:
        return list(self._models)

    def is_loaded(self, name: str) -> bool:
        return self._model(name).scheduler is not None

    @property
    def held(self) -> int:
        """Bytes the loaded models (and any being loaded) hold by their plans."""
        with self._lock:
            return sum(m.held for m in self._models.values())

    @contextmanager
    def use(self, name: str) -> Iterator[Scheduler]:
        """The model's Scheduler (an Embedder for an embedding export), loaded first where it is not
        (the caller waits for the load): submit within the block. The model is not unloaded while the block runs, nor while its
        requests run or wait."""
        model = self._model(name)
        with self._lock:
            model.users += 1
        try:
            with model.loading:  # one load at a time of each model; callers of a loaded model pass at once
                if model.scheduler is None:
                    self._load_model(model)
            yield model.scheduler
        finally:
            with self._lock:
                model.users -= 1
                model.last_used = time.monotonic()

    def load(self, name: str) -> None:
        """Load a model now, as its first request would."""
        with self.use(name):
            pass

    def unload(self, name: str) -> bool:
        """Unload a model that is idle; returns whether it was unloaded."""
        model = self._model(name)
        with self._lock:
            if model.scheduler is None or not model.idle:
                return False
            self._unload(model)
        give_back_freed_memory()
        return True

    def loaded_schedulers(self) -> list[Scheduler]:
        with self._lock:
            return [m.scheduler for m in self._models.values() if m.scheduler is not None]

    def stats(self) -> dict[str, float]:
        """Figures for /metrics: models loaded, loads and unloads so far, seconds spent loading."""
        with self._lock:
            models = list(self._models.values())
            return {
                "models_loaded": sum(m.scheduler is not None for m in models),
                "model_loads_total": sum(m.loads for m in models),
                "model_unloads_total": self._unloads,
                "model_load_seconds_total": sum(m.load_seconds for m in models),
                "model_memory_bytes": sum(m.held for m in models),
            }

    def status(self) -> list[dict]:
        """Per model: its name, folder, whether it is loaded and pinned, the bytes it holds, and the
        seconds until it is unloaded (None: not loaded, pinned, in use, or no keep-alive)."""
        with self._lock:
            return [
                {
                    "name": m.name,
                    "folder": str(m.folder),
                    "loaded": m.scheduler is not None,
                    "pinned": m.pinned,
                    "bytes": m.held,
                    "error": m.error,
                    "expires_in_s": self._expires_in(m),
                }
                for m in self._models.values()
            ]

    def _expires_in(self, model: _Model) -> float | None:
        if model.scheduler is None or model.pinned or not model.idle or self.keep_alive is None:
            return None
        return max(0.0, self.keep_alive - (time.monotonic() - model.last_used))

    def close(self, grace: float | None = None) -> None:
        """Stop every loaded model's scheduler (running requests get `grace` seconds) and the keep-alive timer."""
        self._stop.set()
        for model in self._models.values():
            if model.scheduler is not None:
                model.scheduler.close(grace)

    def __enter__(self) -> ModelPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _model(self, name: str) -> _Model:
        model = self._models.get(name)
        if model is None:
            raise ModelNotFoundError(f"no model named {name!r} here: the models are {', '.join(self._models)}")
        return model

    def _load_model(self, model: _Model) -> None:
        need = self._unless_damaged(model, lambda: _planned_bytes(model.folder, self._engine))
        with self._lock:
            self._make_room(model, need)
            model.held = need  # reserved while it loads, so that a concurrent load counts it
        self._say(f"loading model {model.name!r} for a request")
        start = time.perf_counter()
        try:
            scheduler = self._unless_damaged(model, lambda: self._open(model.folder))
        except BaseException:
            with self._lock:
                model.held = 0
            raise
        seconds = time.perf_counter() - start
        with self._lock:
            model.scheduler, model.loads, model.error = scheduler, model.loads + 1, None
            model.load_seconds += seconds
        self._say(f"loaded model {model.name!r} in {seconds:.2f} s ({size_text(need)})")

    def _open(self, folder: Path):
        """The folder's engine as it is now, its small files checked against the manifest first,
        and the Scheduler that serves it (an Embedder serves itself)."""
        verify_files(folder, load_manifest(folder).files, up_to=VERIFIED_FILE_BYTES)
        engine = Engine.load(folder, memory_limit=self.memory_limit, **self._engine)
        if isinstance(engine, Embedder):
            return engine
        return Scheduler(engine, max_batch=self._engine["max_batch"], max_queue=self._max_queue)

    def _unless_damaged(self, model: _Model, step: Callable):
        """`step()`, where a missing or damaged folder makes the model unavailable (UnavailableError
        naming it and the reason); a refusal by settings or memory passes as it is."""
        try:
            return step()
        except (SettingsError, BusyError):
            raise
        except (EdgeInferError, OSError, ValueError) as e:
            model.error = f"{type(e).__name__}: {e}" if not isinstance(e, EdgeInferError) else str(e)
            self._say(f"model {model.name!r} cannot be loaded: {model.error}")
            raise UnavailableError(
                f"the model {model.name!r} is unavailable: {model.error} (the other models are served; "
                "the next request for it loads it again)"
            ) from None

    def _make_room(self, model: _Model, need: int) -> None:
        """Unload idle models, least recently used first, until `need` bytes fit beside the rest."""
        if self.memory_limit is None:
            return
        if need > self.memory_limit:
            raise SettingsError(
                f"model {model.name!r} needs {size_text(need)} but the memory limit is {size_text(self.memory_limit)}: "
                "raise the limit, lower its context or batch, or use a quantized export",
            )
        candidates = sorted(
            (m for m in self._models.values() if m.scheduler is not None and m is not model and not m.pinned and m.idle),
            key=lambda m: m.last_used,
        )
        held = sum(m.held for m in self._models.values())
        if held - sum(m.held for m in candidates) + need > self.memory_limit:  # decided before anything is unloaded
            busy = [m.name for m in self._models.values() if m.held and m is not model and m not in candidates]
            raise BusyError(
                f"model {model.name!r} needs {size_text(need)}, and the {size_text(self.memory_limit)} memory limit is held "
                f"by models that are serving requests or pinned ({', '.join(busy)}): retry when they are idle",
                "memory_busy",
            )
        while sum(m.held for m in self._models.values()) + need > self.memory_limit:
            unloaded = candidates.pop(0)
            self._unload(unloaded)
            self._say(f"unloaded model {unloaded.name!r}, the least recently used idle one, to make room for {model.name!r}")
            give_back_freed_memory()

    def _unload(self, model: _Model) -> None:
        """Under the lock, of an idle model."""
        model.scheduler.close(grace=0)
        model.scheduler, model.held = None, 0
        self._unloads += 1

    def _reap(self) -> None:
        """Unload idle models `keep_alive` seconds after their last use."""
        period = min(1.0, max(self.keep_alive / 4, 0.05))
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._lock:
                expired = [
                    m
                    for m in self._models.values()
                    if m.scheduler is not None and not m.pinned and m.idle and now - m.last_used >= self.keep_alive
                ]
                for model in expired:
                    self._unload(model)
            for model in expired:
                self._say(f"unloaded model {model.name!r}: idle for {self.keep_alive:g} s")
            if expired:
                give_back_freed_memory()


def _planned_bytes(folder: Path, engine_options: dict) -> int:
    """What `Engine.load(folder, **engine_options)` will hold: its memory plan's weights, KV cache
    and prefix cache, and its tokenizer, worked out from the manifest before anything is read."""
    manifest = load_manifest(folder)
    context = serving_context(manifest, engine_options.get("max_context"))
    plan = MemoryPlan.of(manifest, context, engine_options.get("max_batch", 1))
    return plan.total + (engine_options.get("prefix_cache") or 0) * 2**20 + tokenizer_bytes(manifest)
