"""`edgeinfer bench`: load time, TTFT and decode rate per prompt length, memory; a table, JSON, a plot."""

from __future__ import annotations

import json
from pathlib import Path

import click

from edgeinfer.sdk.errors import EdgeInferError

from .options import model_argument, one_model
from .resolve import resolve_export, say


@click.command()
@model_argument
@click.option("--provider", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--threads", default=None, type=int, help="ONNX Runtime intra-op threads [default: one per core].")
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(exists=True, dir_okay=False),
    help='JSON {"prompts": {name: [token ids]}} [default: random ids of 16, 128, 512 and 1024 tokens].',
)
@click.option("--new-tokens", default=128, show_default=True, type=click.IntRange(2, 100000))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 100))
@click.option("--json", "json_file", default="edgeinfer-bench.json", show_default=True, type=click.Path(dir_okay=False))
@click.option("--plot", "plot_file", default=None, type=click.Path(dir_okay=False), help="Also draw the figures into this PNG.")
def bench(model, model_option, provider, threads, prompts_file, new_tokens, repeats, json_file, plot_file):
    """Measure MODEL (an export folder or catalog name [default: smollm2-135m-instruct])."""
    model = one_model(model, model_option, required=False)
    if plot_file:
        _pyplot()  # refused before the benchmark runs, not after
    from edgeinfer.sdk.bench import run_benchmark

    prompts = json.loads(Path(prompts_file).read_text())["prompts"] if prompts_file else None
    result = run_benchmark(resolve_export(model, say), provider, threads, prompts, new_tokens, repeats, say)
    click.echo(f"{result.model}: {result.provider}, {threads or 'default'} threads, {new_tokens} new tokens, median of {repeats}")
    click.echo(
        f"load {result.load_s:.2f} s, RSS after load {result.rss_after_load_mib:.0f} MiB, peak RSS {result.peak_rss_mib:.0f} MiB"
    )
    click.echo(f"{'prompt':>8} {'tokens':>7} {'TTFT ms':>9} {'decode tok/s':>13}")
    for name, figures in result.prompts.items():
        click.echo(f"{name:>8} {figures.prompt_tokens:>7} {figures.ttft_ms:>9.0f} {figures.decode_tokens_per_s:>13.1f}")
    Path(json_file).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    say(f"figures written to {json_file}")
    if plot_file:
        _plot(result, plot_file)
        say(f"plot written to {plot_file}")


def _pyplot():
    """matplotlib's pyplot, drawing to files; EdgeInferError where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EdgeInferError("--plot needs matplotlib: pip install 'edgeinfer[plot]', or leave out --plot") from None
    return plt


def _plot(result, path: str) -> None:
    plt = _pyplot()
    lengths = [f.prompt_tokens for f in result.prompts.values()]
    figure, (ttft, decode) = plt.subplots(1, 2, figsize=(10, 4))
    ttft.plot(lengths, [f.ttft_ms for f in result.prompts.values()], marker="o")
    ttft.set(xlabel="prompt tokens", ylabel="time to first token (ms)", title="Prefill")
    decode.plot(lengths, [f.decode_tokens_per_s for f in result.prompts.values()], marker="o")
    decode.set(xlabel="context (prompt tokens)", ylabel="decode tokens/s", title="Decode")
    figure.suptitle(f"{result.model} ({result.provider})")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
