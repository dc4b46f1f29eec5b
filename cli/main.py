"""The `edgeinfer` command: a thin shell over the SDK and the exporter."""
from __future__ import annotations

import json
import sys

import click

from edgeinfer.sdk.errors import EdgeInferError

from .resolve import _exporter, resolve_export


def say(message: str) -> None:
    click.echo(message, err=True)


@click.group()
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
def cli(debug):
    """Run causal language models through ONNX Runtime."""
    # --debug is read by main(), which turns errors into one line unless it is given.


@cli.command()
@click.argument("model")
@click.option("-o", "--output", required=True, type=click.Path(), help="Folder to write the export to.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
def export(model, output, force):
    """Export MODEL (a folder, a .gguf file, a catalog name or a hub id) to prefill/decode ONNX graphs."""
    exporter = _exporter()
    manifest = exporter.export_model(model, output, exporter.ExportOptions(force=force), say)
    say(f"exported {manifest.source} ({manifest.architecture}, {manifest.kv.num_layers} layers) to {output}")


@cli.command()
@click.argument("prompt")
@click.option("--model", "model", default=None, help="Export folder or catalog name [default: smollm2-135m-instruct].")
@click.option("--max-new-tokens", default=256, show_default=True, type=int)
@click.option("--provider", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads [default: one per core].")
@click.option("--chat", is_flag=True, help="Wrap PROMPT in the model's chat template.")
def run(prompt, model, max_new_tokens, provider, threads, chat):
    """Generate text after PROMPT, streaming it as it is produced."""
    from edgeinfer.sdk import Engine

    engine = Engine.load(resolve_export(model, say), provider=provider, threads=threads)
    say(f"provider: {engine.provider} ({engine.provider_reason})")
    ids = engine.chat_prompt([{"role": "user", "content": prompt}]) if chat else prompt
    for piece in engine.stream(ids, max_new_tokens=max_new_tokens):
        click.echo(piece.text, nl=False)
        sys.stdout.flush()
    click.echo()
    say(f"time to first token {piece.ttft_s * 1000:.0f} ms, {piece.decode_tokens_per_s:.1f} tokens/s, "
        f"prompt {piece.prompt_tokens} tokens, finish: {piece.finish_reason}")


@cli.command()
@click.argument("folder", type=click.Path())
def info(folder):
    """Print an export's manifest and the execution providers usable here."""
    from edgeinfer.sdk.manifest import load_manifest
    from edgeinfer.sdk.runtime import cuda_unusable_reason

    manifest = load_manifest(folder)
    click.echo(json.dumps(manifest.to_dict(), indent=2))
    cuda = cuda_unusable_reason()
    click.echo(f"providers: cpu: usable; cuda: {'usable' if cuda is None else 'not usable (' + cuda + ')'}")


def main() -> None:
    debug = "--debug" in sys.argv[1:]
    try:
        cli.main(standalone_mode=False)
    except EdgeInferError as e:
        if debug:
            raise
        say(f"error: {e}")
        sys.exit(1)
    except click.exceptions.Abort:
        say("interrupted")
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
