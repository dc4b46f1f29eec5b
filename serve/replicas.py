"""The same server with its engines as Ray Serve replicas, for more clients than one engine's batch
or more than one machine (needs the `ray` extra: pip install "edgeinfer[ray]").

`edgeinfer serve --ray` runs the FastAPI app of `edgeinfer serve` (app.create_app) in its own
process, under uvicorn, as the front: the routes, the SSE chunks and the errors are the same code.
Its scheduler is `Replicas`, which sends each request through a streaming DeploymentHandle to the
Ray Serve deployment `edgeinfer`. Each replica of that deployment loads one engine and runs its own
continuous-batching scheduler, and sends the request's pieces back as they come. Ray Serve picks
the replica, restarts one that dies, and scales between a minimum and a maximum.

    app = application(ReplicaSettings(folder="/models/smollm2"), replicas=2)
    ray.init(); handle = serve.run(app, name="edgeinfer", route_prefix=None)
    create_app(lambda: Replicas(handle, folder), "smollm2")  # under uvicorn

The front is this process, not Ray's HTTP proxy in front of replicas that each run the app: the
proxy answers the requests of a replica that died itself (a plain-text 500, or a cut stream), where
no code of ours sees them, and it added more latency (docs/ray.md). Here a
request on a replica that dies ends with an OpenAI-shaped 503 (UnavailableError), or with an error
event in a stream under way, which the client can send again.

A replica is ready only once its engine has loaded (its constructor loads it), and its health
check fails if its scheduler's step loop has stopped. Every response names the replica that served
it in the `x-edgeinfer-replica` header. The export folder must exist, at the same path, on every
node that runs a replica (or on a shared path), and on the front's node for the tokenizer. A
replica whose engine cannot load leaves its EdgeInferError (class and message) with a Ray actor of
the front's (`LoadErrors`), and the front refuses to start with it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.sdk.errors import BusyError, EdgeInferError, SettingsError, UnavailableError
from edgeinfer.sdk.manifest import load_manifest
from edgeinfer.sdk.tokenizer import Tokenizer

from .models import ModelSet

REPLICA_HEADER = "x-edgeinfer-replica"
# Seconds of load above the target before another replica starts (Ray's default is 30: a burst of
# requests on an edge box is over by then). Ray keeps its own 10-minute delay before scaling down.
UPSCALE_DELAY_S = 5
APP = "edgeinfer"  # the Ray Serve application's name, and its deployment's
LOAD_ERRORS, NAMESPACE = "edgeinfer-load-errors", "edgeinfer"  # the actor where replicas leave why they failed to load
log = logging.getLogger("edgeinfer.serve")


@dataclass(frozen=True)
class ReplicaSettings:
    """What each replica loads: the export `folder` (present on every node) and the settings of
    `edgeinfer serve` that shape one engine and its scheduler."""

    folder: str
    model_name: str | None = None  # the name /v1/models gives (default: the folder's name)
    provider: str = "auto"
    threads: int | None = None  # ONNX Runtime threads (default: the replica's CPUs)
    max_context: int | None = None
    max_batch: int = 8
    max_queue: int = 64
    memory_limit: int | None = None  # bytes
    prefix_cache: int | None = None  # MiB
    api_key: str | None = None
    draft: str | None = None
    speculative: str | None = None  # "prompt_lookup" or "draft": the default of requests that do not say
    # Several models (name, folder): each replica serves them all from one ModelPool within
    # `memory_limit`, loading each on its first request there (`folder` is then unused).
    models: tuple[tuple[str, str], ...] = ()
    keep_alive: float | None = 300.0  # seconds an idle model stays loaded in a replica (None: always)
    pin: tuple[str, ...] = ()  # models every replica loads at start and keeps
    allow_image_urls: bool = False  # the front deployment fetches the http(s) images requests name (else: data: URLs only)
    allowed_image_domains: tuple[str, ...] = ()  # ... from these hosts only (serve/image_urls.py)


def application(
    settings: ReplicaSettings,
    replicas: int = 1,
    autoscale: tuple[int, int] | None = None,
    cpus: float = 1.0,
    gpus: float = 0.0,
    target_requests: int | None = None,
    graceful_shutdown: float = 30.0,
    front: bool = False,
):
    """The Ray Serve application of the engines: `replicas` copies (or, with `autoscale` (min,
    max), as many as the load asks for, `target_requests` ongoing requests per replica, default the
    batch), each with `cpus` and `gpus` of Ray's resources; a replica being stopped gives its
    running requests `graceful_shutdown` seconds. With `front`, the app of `edgeinfer serve` runs
    as a Ray Serve ingress deployment before them (behind Ray's HTTP proxy, for `serve run` and
    Ray's config files); `edgeinfer serve --ray` runs it in its own process instead."""
    from ray import serve

    if replicas < 1 or (autoscale is not None and not 1 <= autoscale[0] <= autoscale[1]):
        raise SettingsError(f"replicas must be at least 1 and autoscale MIN:MAX 1 <= MIN <= MAX, got {replicas} and {autoscale}")
    scaling = (
        {"num_replicas": replicas}
        if autoscale is None
        else {
            "autoscaling_config": {
                "min_replicas": autoscale[0],
                "max_replicas": autoscale[1],
                "target_ongoing_requests": target_requests or settings.max_batch,
                "upscale_delay_s": UPSCALE_DELAY_S,
            }
        }
    )
    options = {"num_cpus": cpus, **({"num_gpus": gpus} if gpus else {})}
    deployment = serve.deployment(
        _replica_class(),
        name=APP,
        ray_actor_options=options,
        max_ongoing_requests=settings.max_batch + settings.max_queue,
        health_check_period_s=5,
        graceful_shutdown_timeout_s=graceful_shutdown,
        logging_config={"log_level": "WARNING", "enable_access_log": False},
        **scaling,
    )
    engines = deployment.bind(settings, cpus)
    if not front:
        return engines
    return serve.deployment(
        _front_class(),
        name=f"{APP}-front",
        ray_actor_options={"num_cpus": 0},
        logging_config={"log_level": "WARNING", "enable_access_log": False},
    ).bind(settings, engines)


def _replica_class():
    """The deployment class (made here, so that importing this module needs no Ray)."""
    from ray import serve

    class EngineReplica:
        def __init__(self, settings: ReplicaSettings, cpus: float):
            try:
                self.engine, self.scheduler = load_replica(settings, cpus)
            except EdgeInferError as e:
                _report_load_error(e)
                raise
            self.name = serve.get_replica_context().replica_id.unique_id

        def mode(self) -> str:
            return self.scheduler.mode

        async def generate(self, prompt, settings: dict, model: str | None = None):
            """First this replica's name, or the EdgeInferError that refused the request; then the
            request's pieces, and an error of the step loop as an item (sent whole, its type kept).
            `model` names one of several models (ReplicaSettings.models)."""
            from .backend import pieces, submit_all

            backend = self.scheduler if model is None else self.scheduler.backend(model)
            try:
                (request,) = await submit_all(backend, lambda: [(prompt, settings)])
            except EdgeInferError as e:
                yield e
                return
            yield self.name
            ended = False
            try:
                async for _, piece in pieces([request]):
                    yield piece
                ended = True
            except EdgeInferError as e:
                ended = True
                yield e
            finally:
                if not ended:  # the front cancelled it (its client went away, or it is stopping)
                    request.cancel()

        def check_health(self) -> None:
            schedulers = self.scheduler.pool.loaded_schedulers() if self.engine is None else [self.scheduler]
            if not all(s.is_alive for s in schedulers if hasattr(s, "is_alive")):
                raise RuntimeError("the scheduler's step loop has stopped")

    return EngineReplica


def _front_class():
    from ray import serve

    @serve.ingress()
    class EdgeInferFront:
        def __init__(self, settings: ReplicaSettings, engines):
            self.settings, self.engines = settings, engines

        def __serve_build_asgi_app__(self):
            from .app import create_app

            name = self.settings.model_name or Path(self.settings.folder).name
            settings = self.settings
            return create_app(
                lambda: Replicas(self.engines, settings.folder, settings.max_context),
                name,
                settings.api_key,
                allow_image_urls=settings.allow_image_urls,
                allowed_image_domains=tuple(settings.allowed_image_domains),
            )

    return EdgeInferFront


def load_replica(settings: ReplicaSettings, cpus: float = 1.0):
    """The engine and scheduler of one replica; with several models, None and their PooledModels."""
    from edgeinfer.sdk import Engine, ModelPool, Scheduler

    from .models import PooledModels

    if settings.models:
        engine = dict(provider=settings.provider, threads=settings.threads or max(1, int(cpus)), max_context=settings.max_context)
        pool = ModelPool(
            dict(settings.models),
            settings.memory_limit,
            settings.keep_alive,
            settings.pin,
            settings.max_batch,
            settings.max_queue,
            prefix_cache=settings.prefix_cache,
            **engine,
        )
        for name in settings.pin:
            pool.load(name)
        return None, PooledModels(pool, settings.max_context)

    engine = Engine.load(
        settings.folder,
        provider=settings.provider,
        threads=settings.threads or max(1, int(cpus)),
        max_context=settings.max_context,
        max_batch=settings.max_batch,
        memory_limit=settings.memory_limit,
        prefix_cache=settings.prefix_cache,
        draft=settings.draft,
    )
    if settings.speculative:
        engine.speculate_by_default(settings.speculative)
    return engine, Scheduler(engine, max_batch=settings.max_batch, max_queue=settings.max_queue)


class Replicas:
    """The front's backend (backend.Backend): `submit` sends a request to one replica of the
    deployment behind `handle` (Ray Serve picks it) and returns once the replica has taken it, or
    raises what refused it (a full queue, a bad setting: the replica's own error). `close` stops
    taking requests and gives those in flight `grace` seconds. The tokenizer of the export at
    `folder` renders and encodes the prompts here; no graph is loaded."""

    def __init__(self, handle, folder: str | Path, max_context: int | None = None, model: str | None = None):
        self.model, self.folder = model, Path(folder)  # which of the replicas' several models (None: their one model)
        self.manifest = load_manifest(folder)
        self.tokenizer = Tokenizer(Path(folder), self.manifest.tokenizer)
        self.max_context = max_context or self.manifest.max_context
        self.handle = handle
        self.mode = f"Ray Serve replicas ({handle.mode.remote().result()} each)"
        self.running: set[RemoteRequest] = set()  # in flight through this front
        self.closing = False

    def submit(self, prompt, **settings) -> RemoteRequest:
        if self.closing:
            raise BusyError("the server is stopping: send the request again once it is back")
        request = RemoteRequest(self.handle.options(stream=True).generate.remote(prompt, settings, self.model), self)
        first = request.next()
        if isinstance(first, BaseException):
            raise first
        request.response_headers = {REPLICA_HEADER: first}
        self.running.add(request)
        return request

    def stats(self) -> dict[str, float]:
        return {}  # each replica keeps its own queue and cache

    def close(self, grace: float | None = None) -> None:
        self.closing = True
        deadline = time.monotonic() + (grace or 0)
        while self.running and time.monotonic() < deadline:
            time.sleep(0.1)
        for request in list(self.running):
            request.stop()


class ReplicaModels(ModelSet):
    """The front's backend for several models: one Replicas per model, on the same deployment (each
    replica serves every model from its own pool). Which models a replica has loaded is its own
    business, so /v1/models does not say."""

    def __init__(self, handle, models: tuple[tuple[str, str], ...], max_context: int | None = None):
        self.backends = {name: Replicas(handle, folder, max_context, name) for name, folder in models}
        self.mode = f"{len(self.backends)} models on Ray Serve replicas, each loaded on demand in each replica"


class RemoteRequest:
    """A request on a replica, as the app sees a scheduler's request: `forward` hands its pieces
    to a callback (from a thread of its own that reads the replica's stream), `cancel` ends it."""

    def __init__(self, stream, owner: Replicas):
        self.stream, self.owner = stream, owner
        self.cancelled = self.stopped = False
        self.response_headers: dict[str, str] = {}

    def next(self):
        """The stream's next item: a Piece, the replica's name, an EdgeInferError, or None at the end."""
        from ray.exceptions import ActorUnavailableError, RayActorError, RayError
        from ray.serve.exceptions import RequestCancelledError

        try:
            return next(self.stream)
        except StopIteration:
            return None
        except RequestCancelledError:
            return BusyError("the server stopped before this request ended: send it again") if self.stopped else None
        except (RayActorError, ActorUnavailableError) as e:
            return UnavailableError(f"the replica serving this request stopped ({first_line(e)}): send the request again")
        except RayError as e:
            return EdgeInferError(f"the replica failed: {first_line(e)}")

    def forward(self, deliver) -> None:
        threading.Thread(target=self._pump, args=(deliver,), name="edgeinfer-replica-stream", daemon=True).start()

    def _pump(self, deliver) -> None:
        try:
            while (item := self.next()) is not None:
                deliver(item)
                if isinstance(item, BaseException):
                    return
            deliver(None)
        finally:
            self.owner.running.discard(self)

    def cancel(self) -> None:
        self.cancelled = True
        self.stream.cancel()

    def stop(self) -> None:
        """Cancel, and end with a BusyError (the server is stopping)."""
        self.stopped = True
        self.cancel()


def run_replicas(
    settings: ReplicaSettings,
    host: str,
    port: int,
    replicas: int = 1,
    autoscale: tuple[int, int] | None = None,
    address: str | None = None,
    cpus: float = 1.0,
    gpus: float = 0.0,
    options=None,
) -> None:
    """Start a Ray cluster on this machine (or join the one at `address`), deploy the replicas, and
    serve them on host:port until SIGTERM or Ctrl-C (`edgeinfer serve`'s server with `options`, a
    server.ServerOptions, /health saying 503 until every replica has loaded); running requests get
    `options.grace` seconds, then the deployment is deleted (and the cluster this call started is
    stopped)."""
    import ray
    from ray import serve

    from .server import ServerOptions, run_server

    options = options or ServerOptions(api_key=settings.api_key)
    grace = options.grace

    _join_or_start(ray, address)
    count = f"{replicas} replica{'s' * (replicas > 1)}" if autoscale is None else f"{autoscale[0]} to {autoscale[1]} replicas"
    errors = _load_errors_class().options(name=LOAD_ERRORS, namespace=NAMESPACE, get_if_exists=True).remote()

    def load():
        try:  # returns once every replica has loaded its engine
            handle = serve.run(
                application(settings, replicas, autoscale, cpus, gpus, graceful_shutdown=grace),
                name=APP,
                route_prefix=None,
                blocking=False,
            )
        except RuntimeError as e:
            raise EdgeInferError(f"the replicas could not start: {_replica_error(errors) or first_line(e)}") from None
        log.info("%s of %s on Ray Serve", count, ", ".join(n for n, _ in settings.models) or settings.folder)
        if settings.models:
            return ReplicaModels(handle, settings.models, settings.max_context)
        return Replicas(handle, settings.folder, settings.max_context)

    try:  # no Ray HTTP proxy: this process is the front
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        name = ", ".join(n for n, _ in settings.models) or settings.model_name or Path(settings.folder).name
        run_server(load, name, host, port, options)
    finally:
        if APP in serve.status().applications:
            serve.delete(APP)
        if address is None:  # the cluster is this command's own; a joined one keeps its other applications
            serve.shutdown()
        ray.shutdown()


def ray_tools_note(dashboard_url: str | None) -> str:
    """How an operator reaches the cluster this command started with Ray's own tools. A new local
    cluster has Ray's token authentication on (its token in ~/.ray/auth_token), and Ray's CLI sends
    the token only in token mode."""
    dashboard = f"http://{dashboard_url}" if dashboard_url and "://" not in dashboard_url else dashboard_url
    return (
        f"Ray dashboard: {dashboard}; Ray's tools: RAY_AUTH_MODE=token ray status, "
        f"RAY_AUTH_MODE=token serve status --address {dashboard}"
    )


def _check_reachable(address: str | None, seconds: float = 5.0) -> None:
    """Refuse, within `seconds`, a cluster address (HOST:PORT or ray://HOST:PORT) where nothing
    answers: ray.init would retry for minutes."""
    import socket

    if address in (None, "auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not port.isdigit():
        raise EdgeInferError(f"--address {address!r} is not auto, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=seconds).close()
    except OSError as e:
        raise EdgeInferError(
            f"cannot reach the Ray cluster at {address} ({e}): start one with `ray start --head` there, "
            "or leave --address out for a cluster on this machine"
        ) from None


def _join_or_start(ray, address: str | None) -> None:
    """ray.init: the cluster at `address`, or else a new one on this machine ("local", even where
    RAY_ADDRESS names another) with its dashboard on loopback, which `serve status` and the
    dashboard's pages need."""
    _check_reachable(address)
    own = {"include_dashboard": True, "dashboard_host": "127.0.0.1"} if address is None else {}
    try:
        context = ray.init(address=address or "local", logging_level="WARNING", **own)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise EdgeInferError(
            f"cannot reach the Ray cluster at {address} ({first_line(e)}): start one with `ray start --head` "
            "there, or leave --address out for a cluster on this machine"
        ) from None
    if address is None:
        log.info("%s", ray_tools_note(context.dashboard_url))


def _load_errors_class():
    """A Ray actor (made here, so that importing this module needs no Ray) that keeps the first
    EdgeInferError a replica's engine raised while loading, as (class name, message)."""
    import ray

    @ray.remote(num_cpus=0)
    class LoadErrors:
        def __init__(self):
            self.first = None

        def report(self, kind: str, message: str) -> None:
            self.first = self.first or (kind, message)

        def get(self):
            return self.first

    return LoadErrors


def _report_load_error(error: EdgeInferError) -> None:
    """Leave `error` with the front's LoadErrors actor; without one (an application run by Ray's
    own `serve run`), Ray Serve's status and logs have it."""
    import ray

    try:
        errors = ray.get_actor(LOAD_ERRORS, namespace=NAMESPACE)
        ray.get(errors.report.remote(type(error).__name__, str(error)), timeout=10)
    except (ValueError, ray.exceptions.RayError):
        return


def _replica_error(errors) -> str | None:
    """The replicas' own error, "Class: message", from the LoadErrors actor `errors`."""
    import ray

    try:
        found = ray.get(errors.get.remote(), timeout=10)
    except ray.exceptions.RayError:
        return None
    if found is None:
        return None
    kind, message = found
    where = " (the export folder must exist at the same path on every node that runs a replica)" if kind == "NotAnExportError" else ""
    return f"{kind}: {message}{where}"


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
