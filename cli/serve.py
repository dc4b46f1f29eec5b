"""`edgeinfer serve`: the OpenAI-compatible server (edgeinfer.serve) with the CLI's model resolution."""
from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import click

from edgeinfer.models import DEFAULT_MODEL
from edgeinfer.sdk.errors import EdgeInferError

from .resolve import load_engine


@click.command()
@click.option("--model", default=None, help="Export folder or catalog name [default: smollm2-135m-instruct].")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1, 1024), help="Requests decoded together.")
@click.option("--max-context", default=None, type=int, help="Tokens per request, prompt and reply [default: the export's].")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(0, 10**6), help="Requests that may wait for a row.")
@click.option("--api-key", default=None, envvar="EDGEINFER_API_KEY", help="Require 'Authorization: Bearer KEY' [env: EDGEINFER_API_KEY].")
@click.option("--provider", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads [default: one per core].")
@click.option("--memory-limit", default=None, type=int, help="MiB the weights and KV pool may use [default: what is free].")
@click.option("--prefix-cache", default=None, type=click.IntRange(0), metavar="MIB",
              help="MiB of prompts' keys and values kept for prompts that start the same way (0: off) [default: 64].")
@click.option("--draft", default=None, metavar="MODEL",
              help="A smaller export (folder or catalog name) with the same tokenizer that proposes tokens (speculative: draft).")
@click.option("--speculative", type=click.Choice(["prompt-lookup", "draft"]), default=None,
              help="Speculative decoding for requests that do not ask themselves [default: off; draft where --draft is given].")
@click.option("--grace", default=30.0, show_default=True, type=click.FloatRange(0), help="Seconds running requests get to finish on SIGTERM.")
def serve(model, host, port, max_batch, max_context, max_queue, api_key, provider, threads, memory_limit, prefix_cache, draft,
          speculative, grace):
    """Serve MODEL over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models), with
    continuous batching, /health and /metrics."""
    try:
        from edgeinfer.serve import run_server
    except ImportError as e:
        raise EdgeInferError(f"serving needs the serve extra ({e.name} is missing): pip install 'edgeinfer[serve]'") from None
    from edgeinfer.sdk import Scheduler

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    path = Path(model).expanduser() if model else None
    name = path.name if path is not None and path.exists() else (model or DEFAULT_MODEL)

    def load():  # --memory-limit 0: no limit, as before
        engine = load_engine(model, provider, threads, max_context, memory_limit or None, prefix_cache, max_batch, draft)
        mode = speculative.replace("-", "_") if speculative else "draft" if draft else None
        if mode:  # the default of requests that do not say
            engine.default_config = dataclasses.replace(engine.default_config, speculative=mode)
            engine._speculation(engine.default_config, 1, engine.max_context)  # refused now, not at every request
        return engine, Scheduler(engine, max_batch=max_batch, max_queue=max_queue)

    run_server(load, name, host, port, api_key, grace)
