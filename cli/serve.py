"""`edgeinfer serve`: the OpenAI-compatible server (edgeinfer.serve) with the CLI's model resolution."""

from __future__ import annotations

import functools
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from edgeinfer.models import DEFAULT_MODEL, is_hub_id
from edgeinfer.sdk.errors import EdgeInferError
from edgeinfer.sdk.manifest import load_manifest

from .resolve import load_engine, resolve_export, say


@click.command()
@click.option(
    "-m",
    "--model",
    "models",
    multiple=True,
    help="Export folder or catalog name; repeatable, for several models [default: smollm2-135m-instruct].",
)
@click.option(
    "--models",
    "models_dir",
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="A folder of exports, each served under its folder's name.",
)
@click.option(
    "--keep-alive",
    default=None,
    type=float,
    help="With several models: seconds an idle model stays loaded (0: unload at once; -1: never) [default: 300].",
)
@click.option("--pin", multiple=True, metavar="NAME", help="With several models: keep this one loaded; repeatable.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1, 1024), help="Requests decoded together.")
@click.option("--max-context", default=None, type=int, help="Tokens per request, prompt and reply [default: the export's].")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(0, 10**6), help="Requests that may wait for a row.")
@click.option(
    "--api-key", default=None, envvar="EDGEINFER_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/ [env: EDGEINFER_API_KEY]."
)
@click.option(
    "--metrics-key",
    default=None,
    envvar="EDGEINFER_METRICS_KEY",
    help="Require 'Authorization: Bearer KEY' on /metrics [env: EDGEINFER_METRICS_KEY; default: /metrics is open].",
)
@click.option(
    "--cors-origin",
    "cors_origins",
    multiple=True,
    metavar="ORIGIN",
    help="A web origin (https://app.example) whose pages may call the API; repeatable; '*' for any [default: none].",
)
@click.option(
    "--header-timeout",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds a connection may take to send a request's headers.",
)
@click.option(
    "--body-timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds a request may take to send its body.",
)
@click.option("--provider", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads [default: one per core].")
@click.option("--memory-limit", default=None, type=int, help="MiB the weights and KV pool may use [default: what is free].")
@click.option(
    "--prefix-cache",
    default=None,
    type=click.IntRange(0),
    metavar="MIB",
    help="MiB of prompts' keys and values kept for prompts that start the same way (0: off) [default: 64].",
)
@click.option(
    "--draft",
    default=None,
    metavar="MODEL",
    help="A smaller export (folder or catalog name) with the same tokenizer that proposes tokens (speculative: draft).",
)
@click.option(
    "--speculative",
    type=click.Choice(["prompt-lookup", "draft"]),
    default=None,
    help="Speculative decoding for requests that do not ask themselves [default: off; draft where --draft is given].",
)
@click.option(
    "--grace", default=30.0, show_default=True, type=click.FloatRange(0), help="Seconds running requests get to finish on SIGTERM."
)
@click.option(
    "--chat-template",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    metavar="FILE",
    help="One model: a Jinja chat template (or a tokenizer_config.json with one) in place of the export's.",
)
@click.option("--no-ui", is_flag=True, help="Serve no chat page at / (the API alone).")
@click.option(
    "--allow-image-urls",
    is_flag=True,
    help="Fetch the http(s) image URLs requests name from public addresses (by default only data: URLs are taken: the box "
    "fetches nothing a client names).",
)
@click.option(
    "--allowed-image-domains",
    default=None,
    metavar="HOST,...",
    help="Fetch image URLs from these hosts (and their subdomains) only, wherever they resolve (an intranet store included).",
)
@click.option(
    "--responses-store",
    "store_count",
    default=256,
    show_default=True,
    type=click.IntRange(0),
    metavar="N",
    help="Responses API: responses kept for previous_response_id and GET (0: none).",
)
@click.option(
    "--responses-store-mib",
    "store_mib",
    default=64,
    show_default=True,
    type=click.IntRange(0),
    metavar="MIB",
    help="Responses API: MiB the kept responses may hold.",
)
@click.option(
    "--responses-store-ttl",
    "store_ttl",
    default=3600.0,
    show_default=True,
    type=float,
    metavar="S",
    help="Responses API: seconds a kept response stays after its last use (-1: until the count or MiB bound drops it).",
)
@click.option("--ray", "on_ray", is_flag=True, help="Run the server as Ray Serve replicas (the ray extra; see --replicas).")
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(1), help="With --ray: replicas, each its own engine.")
@click.option("--autoscale", default=None, metavar="MIN:MAX", help="With --ray: as many replicas as the load asks for, MIN to MAX.")
@click.option("--address", default=None, help="With --ray: the cluster to join (auto, or ray://HOST:10001) [default: a local one].")
@click.option("--replica-cpus", default=1.0, show_default=True, type=click.FloatRange(min=0.01), help="With --ray: CPUs per replica.")
@click.option("--replica-gpus", default=0.0, show_default=True, type=click.FloatRange(min=0), help="With --ray: GPUs per replica.")
def serve(
    models,
    models_dir,
    keep_alive,
    pin,
    host,
    port,
    max_batch,
    max_context,
    max_queue,
    api_key,
    metrics_key,
    cors_origins,
    header_timeout,
    body_timeout,
    provider,
    threads,
    memory_limit,
    prefix_cache,
    draft,
    speculative,
    grace,
    chat_template,
    no_ui,
    allow_image_urls,
    allowed_image_domains,
    store_count,
    store_mib,
    store_ttl,
    on_ray,
    replicas,
    autoscale,
    address,
    replica_cpus,
    replica_gpus,
):
    """Serve MODEL over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models), with
    continuous batching, /health, /metrics and /openapi.json; with --ray, as Ray Serve replicas."""
    store, images = (store_count, store_mib * 2**20, None if store_ttl < 0 else store_ttl), (allow_image_urls, allowed_image_domains)
    options = _server_options(api_key, metrics_key, cors_origins, header_timeout, body_timeout, grace, not no_ui, store, images)
    from edgeinfer.serve import run_server

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    ray = (replicas, _min_max(autoscale), address, replica_cpus, replica_gpus) if on_ray else None
    several = len(models) > 1 or models_dir is not None
    _check_scope(several, on_ray, keep_alive, pin, chat_template, (replicas, autoscale, address))
    if several:
        engine = dict(provider=provider, threads=threads, max_context=max_context, prefix_cache=prefix_cache)
        pool = _PoolSettings(memory_limit * 2**20 if memory_limit else None, keep_alive, pin, max_batch, max_queue, engine)
        return _serve_several(models, models_dir, pool, bool(draft or speculative), ray, host, port, options)
    name, model = _named(models[0]) if models else (DEFAULT_MODEL, None)
    mode = speculative.replace("-", "_") if speculative else "draft" if draft else None
    if on_ray:
        limit = memory_limit * 2**20 if memory_limit else None
        engine = (provider, threads, max_context, max_batch, max_queue, limit, prefix_cache, api_key)
        return _serve_on_ray(model, name, draft, mode, engine, ray, host, port, options)
    engine = (model, provider, threads, max_context, memory_limit or None, prefix_cache, max_batch, draft)  # --memory-limit 0: none
    run_server(functools.partial(_one_model, engine, chat_template, mode, max_batch, max_queue), name, host, port, options)


def _check_scope(several: bool, on_ray: bool, keep_alive, pin, chat_template, ray_flags: tuple) -> None:
    """Flags that apply to one way of serving only, refused with another."""
    if not several and (keep_alive is not None or pin):
        raise click.UsageError("--keep-alive and --pin apply to several models (--model repeated, or --models)")
    if chat_template and (several or on_ray):
        raise click.UsageError("--chat-template applies to one model served without --ray")
    if not on_ray and ray_flags != (1, None, None):
        raise click.UsageError("--replicas, --autoscale and --address apply to --ray")


def _serve_on_ray(model, name: str, draft, mode, engine: tuple, ray: tuple, host: str, port: int, options) -> None:
    """`serve --ray`: one model's engines as Ray Serve replicas (serve/replicas.py)."""
    from edgeinfer.serve.replicas import ReplicaSettings, run_replicas

    folder = str(resolve_export(model, say).resolve())
    if load_manifest(folder).task == "embedding":
        raise click.UsageError("--ray serves generation models: serve an embedding model (--task embedding) without --ray")
    draft_folder = None if draft is None else str(resolve_export(draft, say).resolve())
    run_replicas(ReplicaSettings(folder, name, *engine, draft_folder, mode), host, port, *ray, options)


def _one_model(engine_args: tuple, chat_template: str | None, mode: str | None, max_batch: int, max_queue: int):
    from edgeinfer.sdk import Embedder, Scheduler

    engine = load_engine(*engine_args, embeddings=True, chat_template=chat_template)
    if isinstance(engine, Embedder):  # an embedding model serves /v1/embeddings itself
        return engine
    if mode:  # the default of requests that do not say
        engine.speculate_by_default(mode)
    return Scheduler(engine, max_batch=max_batch, max_queue=max_queue)


def _named(given: str) -> tuple[str, str]:
    """(the name requests use, the model to load) of a --model: NAME=MODEL names it; a catalog name
    is its own name; an export folder is named by the hub id it was exported from, else by its
    folder's name."""
    name, given_name, model = given.partition("=")
    if given_name and re.fullmatch(r"[A-Za-z0-9][\w./-]*", name) and not Path(given).expanduser().exists():
        return name, model
    path = Path(given).expanduser()
    if not path.exists():
        return given, given
    try:
        source = load_manifest(path).source
    except EdgeInferError:  # not an export: loading it says why
        return path.name, given
    return (source if is_hub_id(source) and not Path(source).exists() else path.name), given


def _named_exports(models: tuple[str, ...], models_dir: Path | None) -> dict[str, Path]:
    """Each model's name (its folder's name, or its catalog name) and export folder; two of one
    name are refused."""
    served: dict[str, Path] = {}
    candidates = [(name, resolve_export(model, say)) for name, model in map(_named, models)]
    if models_dir is not None:
        if not models_dir.is_dir():
            raise click.BadParameter(f"{models_dir} is not a folder", param_hint="--models")
        found = sorted(p for p in models_dir.iterdir() if (p / "edgeinfer.json").is_file())
        for other in sorted(p for p in models_dir.iterdir() if p.is_dir() and p not in found):
            what = "a Hugging Face model folder" if (other / "config.json").is_file() else "no export (no edgeinfer.json)"
            say(f"--models: not serving {other.name}: {what}; `edgeinfer export {other} -o OUT` makes an export of it")
        if not found:
            raise click.BadParameter(f"{models_dir} holds no export folder (one with an edgeinfer.json)", param_hint="--models")
        candidates += [(p.name, p) for p in found]
    for name, folder in candidates:
        if name in served:
            raise click.BadParameter(
                f"two models are named {name!r} ({served[name]} and {folder}): serve one of them, or rename a folder",
                param_hint="--model",
            )
        served[name] = folder
    return served


@dataclass(frozen=True)
class _PoolSettings:
    limit: int | None  # bytes; None: the memory free at start
    keep_alive: float | None  # seconds; None: the default; negative: never
    pin: tuple[str, ...]
    max_batch: int
    max_queue: int
    engine: dict


def _serve_several(models, models_dir, settings: _PoolSettings, draft: bool, ray: tuple | None, host: str, port: int, options) -> None:
    """Several models from one pool; with `ray` (replicas, autoscale, address, cpus, gpus), each Ray
    Serve replica serves them all from its own pool."""
    from edgeinfer.serve import run_server

    if draft:
        raise click.UsageError("--draft and --speculative serve one model: give one --model")
    served = _named_exports(models, models_dir)
    for name in settings.pin:
        if name not in served:
            raise click.BadParameter(f"{name!r} is not among the models served ({', '.join(served)})", param_hint="--pin")
    if ray is None:
        run_server(lambda: _pool(served, settings), ", ".join(served), host, port, options)
        return
    from edgeinfer.serve.replicas import ReplicaSettings, run_replicas

    engine = settings.engine
    replica = ReplicaSettings(
        folder="",
        provider=engine["provider"],
        threads=engine["threads"],
        max_context=engine["max_context"],
        max_batch=settings.max_batch,
        max_queue=settings.max_queue,
        memory_limit=settings.limit,
        prefix_cache=engine["prefix_cache"],
        api_key=options.api_key,
        models=tuple((name, str(folder.resolve())) for name, folder in served.items()),
        keep_alive=_keep_alive(settings),
        pin=tuple(settings.pin),
    )
    run_replicas(replica, host, port, *ray, options)


def _keep_alive(settings: _PoolSettings) -> float | None:
    """--keep-alive as the pool takes it: the default where not given, None (never) where negative."""
    from edgeinfer.sdk.pool import DEFAULT_KEEP_ALIVE_S

    return DEFAULT_KEEP_ALIVE_S if settings.keep_alive is None else None if settings.keep_alive < 0 else settings.keep_alive


def _pool(served: dict[str, Path], settings: _PoolSettings):
    """The served models as a pool, the pinned ones loaded."""
    from edgeinfer.sdk.memory import available_bytes
    from edgeinfer.sdk.pool import ModelPool
    from edgeinfer.serve.models import PooledModels

    limit = settings.limit
    if limit is None:
        limit, _ = available_bytes("cuda" if settings.engine["provider"] == "cuda" else "cpu", None)
    keep = _keep_alive(settings)
    log = logging.getLogger("edgeinfer.serve")
    pool = ModelPool(
        served, limit, keep, tuple(settings.pin), settings.max_batch, settings.max_queue, on_event=log.info, **settings.engine
    )
    for name in settings.pin:
        pool.load(name)
    return PooledModels(pool, settings.engine["max_context"])


def _server_options(
    api_key, metrics_key, cors_origins, header_timeout, body_timeout, grace, ui=True, store=None, image_urls=(False, None)
):
    """The server's options, once the serve extra is known to be installed and the flags are sound;
    `store`: the Responses store's (count, bytes, ttl or None); `image_urls`: --allow-image-urls
    and --allowed-image-domains."""
    try:
        from edgeinfer.serve import ServerOptions
        from edgeinfer.serve.responses import StoreLimits
    except ImportError as e:
        raise EdgeInferError(f"serving needs the serve extra ({e.name} is missing): pip install 'edgeinfer[serve]'") from None
    _check_keys(api_key, metrics_key)
    _check_origins(cors_origins)
    limits = StoreLimits() if store is None else StoreLimits(*store)
    allowed, domains = image_urls[0], _domains(image_urls[1])
    return ServerOptions(api_key, metrics_key, tuple(cors_origins), header_timeout, body_timeout, grace, ui, limits, allowed, domains)


def _domains(text: str | None) -> tuple[str, ...]:
    """--allowed-image-domains as hosts: names or IP addresses, comma-separated, no scheme or port."""
    if text is None:
        return ()
    hosts = tuple(h.strip().lower().strip(".").strip("[]") for h in text.split(","))
    for host in hosts:
        if not host or any(c in host for c in "/@ ") or (":" in host and not _is_address(host)):
            raise click.BadParameter(
                f"{host!r} is not a host: give names or addresses, comma-separated, without scheme or port "
                "(images.example.com,10.0.0.5)",
                param_hint="--allowed-image-domains",
            )
    return hosts


def _is_address(text: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _check_keys(api_key: str | None, metrics_key: str | None) -> None:
    for flag, key in (("--api-key", api_key), ("--metrics-key", metrics_key)):
        if key is not None and not key.strip():
            raise click.BadParameter(
                "an empty key would turn authentication off: give a key, or leave the option (and its "
                "environment variable) out to serve without one",
                param_hint=flag,
            )


def _check_origins(cors_origins) -> None:
    for origin in cors_origins:
        if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
            raise click.BadParameter(
                f"{origin!r} is not an origin: scheme and host, with a port where it has one "
                "(http://localhost:3000), no path; or '*' for any",
                param_hint="--cors-origin",
            )


def _min_max(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    low, _, high = text.partition(":")
    if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
        raise click.BadParameter(f"{text!r} is not MIN:MAX with 1 <= MIN <= MAX (e.g. 1:4)", param_hint="--autoscale")
    return int(low), int(high)
