"""Several models behind one server: the SDK's ModelPool loads and unloads them within the memory
budget, and each model is a Backend to the routes, named by the request's `model`."""

from __future__ import annotations

from pathlib import Path

from edgeinfer.sdk.engine import serving_context
from edgeinfer.sdk.errors import UnavailableError
from edgeinfer.sdk.manifest import MANIFEST_NAME, load_manifest
from edgeinfer.sdk.pool import ModelPool

from .checks import RequestError


def model_fields(manifest, folder: Path | str | None) -> dict:
    """What /v1/models says of an export besides its name: when it was exported (its manifest's
    time; 0 where the folder is not on this machine), its context, its weights' precision and the
    bytes of its files."""
    written = Path(folder) / MANIFEST_NAME if folder else None
    return {
        "created": int(written.stat().st_mtime) if written is not None and written.exists() else 0,
        "context_length": manifest.max_context,
        "precision": manifest.precision,
        "size_bytes": sum(int(f.get("size", 0)) for f in manifest.files.values()),
    }


def held_bytes(backend) -> int | None:
    """The bytes a loaded model's engine planned for (weights, KV cache, prefix cache); None where
    the backend has no engine here (Ray replicas)."""
    plan = getattr(getattr(backend, "engine", None), "memory", None)
    return None if plan is None else plan.total


def folder_of(backend) -> Path | None:
    """The export folder a backend serves from (a Scheduler's engine's, a pooled model's, the replicas')."""
    return getattr(getattr(backend, "engine", None), "folder", None) or getattr(backend, "folder", None)


class PooledBackend:
    """One model of the pool: its manifest as last read (for listings), `loaded()` for what a
    request renders and submits with, and a submit of prompt ids (a replica's) that loads it
    first where it is not loaded."""

    def __init__(self, pool: ModelPool, name: str, folder: Path, max_context: int | None):
        self.pool, self.name, self.folder = pool, name, Path(folder)
        self.manifest = load_manifest(folder)
        self.max_context = serving_context(self.manifest, max_context)
        self.mode = f"{name}: loaded on demand"

    def loaded(self) -> LoadedModel:
        """The model as its engine loaded it (loading it first where it is not loaded; off the event loop)."""
        with self.pool.use(self.name) as served:
            engine = getattr(served, "engine", served)  # a Scheduler's engine; an Embedder serves itself
            self.manifest = engine.manifest
            return LoadedModel(self, engine)

    def submit(self, prompt, **settings):
        with self.pool.use(self.name) as scheduler:
            return scheduler.submit(prompt, **settings)

    def embed(self, texts, **settings):
        """An embedding model's vectors (the model stays loaded while it embeds)."""
        with self.pool.use(self.name) as embedder:
            return embedder.embed(texts, **settings)


class LoadedModel:
    """One load of a pooled model as a request sees it: the manifest, tokenizer and context of that
    load, and a submit that refuses to pair them with another load of a folder that has changed
    since (the prompt was rendered with this tokenizer). The tokenizer goes when the model is
    unloaded and no request holds this."""

    def __init__(self, backend: PooledBackend, engine):
        self.backend, self.name, self.mode = backend, backend.name, backend.mode
        self.manifest, self.tokenizer, self.max_context = engine.manifest, engine.tokenizer, engine.max_context

    def submit(self, prompt, **settings):
        with self.backend.pool.use(self.name) as scheduler:
            if scheduler.engine.manifest.files != self.manifest.files:
                raise UnavailableError(
                    f"the model {self.name!r} was loaded again from a changed folder while this request was prepared: send it again"
                )
            return scheduler.submit(prompt, **settings)

    def embed(self, texts, **settings):
        return self.backend.embed(texts, **settings)


class ModelSet:
    """Several models behind one server: `backends` by name, each what the routes serve a request
    for that `model` from (an adapter's name, BASE:ADAPTER, is its base's backend with it)."""

    backends: dict
    mode: str

    @property
    def names(self) -> list[str]:
        return list(self.backends)

    def backend(self, name: str):
        base, _, adapter = name.rpartition(":")
        if name not in self.backends and base in self.backends:
            return with_adapter(self.backends[base], base, adapter)
        if name not in self.backends:
            raise RequestError(
                f"the model '{name}' is not served here: this server serves {', '.join(repr(n) for n in self.backends)}",
                param="model",
                status=404,
                code="model_not_found",
            )
        return self.backends[name]

    def prepared(self, name: str):
        """`backend(name)` as a request renders and submits with it: a pooled model loaded (this may
        load it: call it off the event loop), with the adapter the name asks for."""
        backend = self.backend(name)
        if isinstance(backend, AdapterBackend):
            base, _, adapter = name.rpartition(":")
            return with_adapter(self.ready(backend.backend), base, adapter)
        return self.ready(backend)

    def ready(self, backend):
        """The backend as a request uses it (PooledModels: loaded)."""
        return backend

    def listing(self) -> list[dict]:
        """/v1/models' entries: each model and its adapters, with what `shown` says of it."""
        entries = []
        for name, backend in self.backends.items():
            shown = self.shown(name)
            fields = model_fields(backend.manifest, folder_of(backend))
            entries.append({"id": name, "object": "model", "owned_by": "edgeinfer", **fields, **shown})
            entries += adapter_entries(name, backend.manifest, **shown)
        return entries

    def shown(self, name: str) -> dict:
        """What /v1/models says of a model besides its name."""
        return {}

    def files(self) -> list[str]:
        """Every model's files and hashes, for the system fingerprint."""
        return [
            f"{n}/{name} {info.get('sha256')}" for n, b in self.backends.items() for name, info in sorted(b.manifest.files.items())
        ]

    def stats(self) -> dict[str, float]:
        return {}

    def close(self, grace: float | None = None) -> None:
        for backend in self.backends.values():
            backend.close(grace)


class PooledModels(ModelSet):
    """The models of `pool`, each a PooledBackend."""

    def __init__(self, pool: ModelPool, max_context: int | None = None):
        self.pool = pool
        self.backends = {s["name"]: PooledBackend(pool, s["name"], Path(s["folder"]), max_context) for s in pool.status()}
        limit = "no memory limit" if pool.memory_limit is None else f"a memory limit of {pool.memory_limit / 2**20:.0f} MiB"
        self.mode = f"{len(self.backends)} models loaded on demand within {limit}"

    def ready(self, backend: PooledBackend) -> LoadedModel:
        return backend.loaded()

    def shown(self, name: str) -> dict:
        """Whether the model is loaded, pinned and available (not while its folder fails to load, with the reason)."""
        status = next(s for s in self.pool.status() if s["name"] == name)
        reason = {} if status["error"] is None else {"unavailable_reason": status["error"]}
        expiry = {} if status["expires_in_s"] is None else {"expires_in_s": round(status["expires_in_s"], 1)}
        held = {"memory_bytes": status["bytes"]} if status["loaded"] else {}
        return {
            "loaded": status["loaded"],
            "pinned": status["pinned"],
            "available": status["error"] is None,
            **held,
            **expiry,
            **reason,
        }

    def stats(self) -> dict[str, float]:
        """The pool's figures, and the loaded models' queues and rows summed."""
        totals = dict(self.pool.stats())
        for scheduler in self.pool.loaded_schedulers():
            for key, value in scheduler.stats().items():
                totals[key] = totals.get(key, 0) + value
        return totals

    def close(self, grace: float | None = None) -> None:
        self.pool.close(grace)


class AdapterBackend:
    """A backend's base model with one of its LoRA adapters (`"model": "BASE:ADAPTER"`): every
    request it takes runs with that adapter; all else is the base's."""

    def __init__(self, backend, adapter: str):
        self.backend, self.adapter = backend, adapter

    def submit(self, prompt, **settings):
        return self.backend.submit(prompt, **{**settings, "adapter": self.adapter})

    def __getattr__(self, name: str):
        return getattr(self.backend, name)


def with_adapter(backend, base: str, adapter: str) -> AdapterBackend:
    """`backend` (serving `base`) with `adapter`, or a 404 naming the adapters it has."""
    names = sorted(backend.manifest.adapters)
    if adapter not in names:
        there = f"its adapters are {', '.join(repr(f'{base}:{n}') for n in names)}" if names else "it has no adapters"
        raise RequestError(
            f"the model '{base}:{adapter}' is not served here: '{base}' has no adapter '{adapter}'; {there}",
            param="model",
            status=404,
            code="model_not_found",
        )
    return AdapterBackend(backend, adapter)


def adapter_entries(base: str, manifest, **fields) -> list[dict]:
    """/v1/models' entries of a model's adapters: BASE:ADAPTER, with the base as parent."""
    return [
        {"id": f"{base}:{name}", "object": "model", "created": 0, "owned_by": "edgeinfer", "parent": base, **fields}
        for name in sorted(manifest.adapters)
    ]
