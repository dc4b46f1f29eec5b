"""The same server as Ray Serve replicas, for more clients than one engine's batch or more than one
machine: each replica loads one engine and runs its own continuous-batching scheduler behind the
FastAPI app of `edgeinfer serve` (app.create_app), so the routes, the SSE chunks and the errors are
the same code. Ray Serve routes requests across replicas, restarts one that dies, and scales
between a minimum and a maximum (needs the `ray` extra: pip install "edgeinfer[ray]").

    app = application(ReplicaSettings(folder="/models/smollm2"), replicas=2)
    ray.init(); serve.start(http_options={"port": 8000}); serve.run(app, route_prefix="/")

A replica is ready only once its engine has loaded (its constructor loads it), and its health
check fails if its scheduler's step loop has stopped. Every response names the replica that served
it in the `x-edgeinfer-replica` header. The export folder must exist, at the same path, on every
node that runs a replica (or on a shared path).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from edgeinfer.sdk.errors import EdgeInferError, SettingsError

REPLICA_HEADER = "x-edgeinfer-replica"
# Seconds of load above the target before another replica starts (Ray's default is 30: a burst of
# requests on an edge box is over by then). Ray keeps its own 10-minute delay before scaling down.
UPSCALE_DELAY_S = 5
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


def application(settings: ReplicaSettings, replicas: int = 1, autoscale: tuple[int, int] | None = None,
                cpus: float = 1.0, gpus: float = 0.0, target_requests: int | None = None, graceful_shutdown: float = 30.0):
    """The Ray Serve application: `replicas` copies (or, with `autoscale` (min, max), as many as
    the load asks for, `target_requests` ongoing requests per replica, default the batch), each
    with `cpus` and `gpus` of Ray's resources; a replica being stopped gives its running requests
    `graceful_shutdown` seconds."""
    from ray import serve

    if replicas < 1 or (autoscale is not None and not 1 <= autoscale[0] <= autoscale[1]):
        raise SettingsError(f"replicas must be at least 1 and autoscale MIN:MAX 1 <= MIN <= MAX, got {replicas} and {autoscale}")
    scaling = ({"num_replicas": replicas} if autoscale is None else
               {"autoscaling_config": {"min_replicas": autoscale[0], "max_replicas": autoscale[1],
                                       "target_ongoing_requests": target_requests or settings.max_batch,
                                       "upscale_delay_s": UPSCALE_DELAY_S}})
    options = {"num_cpus": cpus, **({"num_gpus": gpus} if gpus else {})}
    deployment = serve.deployment(_replica_class(), name="edgeinfer", ray_actor_options=options,
                                  max_ongoing_requests=settings.max_batch + settings.max_queue, health_check_period_s=5,
                                  graceful_shutdown_timeout_s=graceful_shutdown,
                                  logging_config={"log_level": "WARNING", "enable_access_log": False}, **scaling)
    return deployment.bind(settings, cpus)


def _replica_class():
    """The deployment class (made here, so that importing this module needs no Ray)."""
    from ray import serve

    @serve.ingress()
    class EdgeInferReplica:
        def __init__(self, settings: ReplicaSettings, cpus: float):
            self.settings = settings
            self.engine, self.scheduler = load_replica(settings, cpus)
            self.replica = serve.get_replica_context().replica_id.unique_id

        def __serve_build_asgi_app__(self):
            from .app import create_app

            name = self.settings.model_name or self.settings.folder.rstrip("/").rsplit("/", 1)[-1]
            return create_app(lambda: (self.engine, self.scheduler), name, self.settings.api_key,
                              headers={REPLICA_HEADER: self.replica})

        def check_health(self) -> None:
            if not self.scheduler.is_alive:
                raise RuntimeError("the scheduler's step loop has stopped")

    return EdgeInferReplica


def load_replica(settings: ReplicaSettings, cpus: float = 1.0):
    """The engine and scheduler of one replica."""
    from edgeinfer.sdk import Engine, Scheduler

    engine = Engine.load(settings.folder, provider=settings.provider, threads=settings.threads or max(1, int(cpus)),
                         max_context=settings.max_context, max_batch=settings.max_batch, memory_limit=settings.memory_limit,
                         prefix_cache=settings.prefix_cache, draft=settings.draft)
    if settings.speculative:
        engine.speculate_by_default(settings.speculative)
    return engine, Scheduler(engine, max_batch=settings.max_batch, max_queue=settings.max_queue)


def run_replicas(settings: ReplicaSettings, host: str, port: int, replicas: int = 1, autoscale: tuple[int, int] | None = None,
                 address: str | None = None, cpus: float = 1.0, gpus: float = 0.0, grace: float = 30.0) -> None:
    """Start a Ray cluster on this machine (or join the one at `address`), deploy the replicas
    behind Ray Serve's proxy on host:port, and serve until SIGTERM or Ctrl-C; then delete the
    deployment, giving running requests `grace` seconds (and stop the cluster this call started)."""
    import signal
    import threading

    import ray
    from ray import serve

    _check_reachable(address)
    try:  # "local": a new cluster on this machine, even where RAY_ADDRESS names another
        ray.init(address=address or "local", include_dashboard=False, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise EdgeInferError(f"cannot reach the Ray cluster at {address} ({first_line(e)}): start one with `ray start --head` "
                             "there, or leave --address out for a cluster on this machine") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # in place of the handlers ray.init installed
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
        app = application(settings, replicas, autoscale, cpus, gpus, graceful_shutdown=grace)
        try:
            serve.run(app, name="edgeinfer", route_prefix="/", blocking=False)
        except RuntimeError as e:
            raise EdgeInferError(f"the replicas could not start: {_deployment_error(serve) or first_line(e)}") from None
        count = f"{replicas} replica{'s' * (replicas > 1)}" if autoscale is None else f"{autoscale[0]} to {autoscale[1]} replicas"
        log.info("listening on http://%s:%d (OpenAI API under /v1): %s", host, port, count)
        while not stop.wait(0.5):
            pass
        log.info("stopping: the replicas get %.0f s to finish their requests", grace)
        serve.delete("edgeinfer")
    finally:
        if address is None:  # the cluster is this command's own; a joined one keeps its other applications
            serve.shutdown()
        ray.shutdown()


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
        raise EdgeInferError(f"cannot reach the Ray cluster at {address} ({e}): start one with `ray start --head` there, "
                             "or leave --address out for a cluster on this machine") from None


def _deployment_error(serve) -> str | None:
    """The replicas' own error (the last line of the exception a replica's constructor raised, an
    EdgeInferError's message where it was one), from Ray Serve's status."""
    try:
        message = serve.status().applications["edgeinfer"].deployments["edgeinfer"].message
    except (KeyError, AttributeError):
        return None
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    error = next((line.split("errors.", 1)[1] for line in reversed(lines) if "edgeinfer.sdk.errors." in line), None)
    if error and error.startswith("NotAnExportError"):
        return f"{error} (the export folder must exist at the same path on every node that runs a replica)"
    return error or (lines[-1] if lines else None)


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
