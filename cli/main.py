"""The `edgeinfer` command: a thin shell over the SDK and the exporter."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
from pathlib import Path

import click

from edgeinfer import __version__
from edgeinfer.export.algorithms import ALGORITHMS
from edgeinfer.sdk.errors import EdgeInferError, ExportError

from edgeinfer.sdk.vision import user_message

from .bench import bench
from .chat import chat
from .manage import list_models, ps, pull, rm
from .options import GENERATION_OPTIONS, MODEL_OPTIONS, generation_settings, in_flags, model_argument, one_model, with_options
from .resolve import _exporter, live_stream, load_engine, quiet_libraries, resolve_export, say, say_timings
from .serve import serve


@click.group()
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.option("-v", "--verbose", is_flag=True, help="Say why the provider was chosen, and show other libraries' logs and warnings.")
@click.version_option(__version__, "-V", "--version", prog_name="edgeinfer", message="%(prog)s %(version)s")
def cli(debug, verbose):
    """Run causal language models through ONNX Runtime."""
    # --debug and --verbose are read by main(): errors in one line, other libraries quiet, unless given.


@cli.command()
@model_argument
@click.option("-o", "--output", required=True, type=click.Path(), help="Folder to write the export to.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
@click.option("--max-context", type=int, default=None, help="Tokens the runtime may hold [default: the model's limit].")
@click.option("--quantize", type=click.Choice(["int4", "int8"]), default=None, help="Quantize the weights [default: fp32].")
@click.option("--block-size", type=int, default=32, show_default=True, help="Weights per quantization scale.")
@click.option("--symmetric", is_flag=True, help="Quantize without zero points: faster, less accurate.")
@click.option(
    "--algorithm",
    type=click.Choice(list(ALGORITHMS)),
    default=None,
    help="How blocks are quantized: "
    + "; ".join(f"{a.name} ({a.about})" for a in ALGORITHMS.values())
    + " [default: gptq for int4, rtn for int8 and --symmetric].",
)
@click.option(
    "--keep-int8",
    default=None,
    metavar="MODULES",
    help="Keep these MatMuls at int8 beside int4, comma-separated: lm_head, or module names with optional layers "
    "(qkv_proj, down_proj:0-3+29); auto: the modules whose 4-bit rounding costs the most per byte, measured on the "
    "calibration text; none [default: auto for int4].",
)
@click.option(
    "--calibration",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A text whose activations k_quant and gptq fit to, and --keep-int8 auto measures on [default: export's calibration text].",
)
@click.option(
    "--embedding-bits",
    type=click.Choice(["4", "8"]),
    default=None,
    help="Bits of an untied embedding table's blocks (a tied table gathers from the lm_head's): 4 for the smallest "
    "files, at some quality [default: 8].",
)
@click.option(
    "--no-quality",
    is_flag=True,
    help="Skip --quantize's quality measure (the quantized and fp32 graphs over a 1,200-token text, against PyTorch's): "
    "faster exports while iterating; the manifest then records no quality.",
)
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "fp16"]),
    default="fp32",
    show_default=True,
    help="Weights, activations and KV cache type (fp16 is for GPUs).",
)
@click.option("--no-fuse", is_flag=True, help="Skip ONNX Runtime's transformer optimizer (fusion) at export.")
@click.option(
    "--stream/--no-stream",
    default=None,
    help="Load the model in its checkpoint's precision and write its fp32 weights one at a time, checking a copy of its "
    "first layers against PyTorch: about half the memory [default: for models of 0.5B parameters or more, from safetensors].",
)
@click.option(
    "--graphs",
    type=click.Choice(["single", "split"]),
    default="single",
    show_default=True,
    help="One graph for prefill and decode, or prefill.onnx and decode.onnx on one weights file (static-shape accelerators).",
)
@click.option(
    "--prefill-length",
    type=int,
    default=None,
    help="With --graphs split: the prefill graph's fixed number of positions (prompts are padded to it) [default: any].",
)
@click.option(
    "--static-context",
    type=int,
    default=None,
    help="With --graphs split: the decode graph's fixed KV cache capacity, one token per pass [default: any].",
)
@click.option(
    "--task",
    type=click.Choice(["generation", "embedding"]),
    default="generation",
    show_default=True,
    help="embedding: the model's hidden states, pooled into one vector per text (/v1/embeddings, Engine.load(...).embed).",
)
@click.option(
    "--pooling",
    type=click.Choice(["last", "mean"]),
    default=None,
    help="With --task embedding: a text's vector is its last token's state or the mean [default: the model's "
    "sentence-transformers config, else last].",
)
@click.option(
    "--matryoshka",
    default=None,
    metavar="WIDTHS",
    help="With --task embedding: the shorter widths the model was trained to give (64,128,256), so that requests may ask "
    "for `dimensions` [default: none].",
)
@click.option(
    "--adapter",
    "adapters",
    multiple=True,
    metavar="NAME=DIR",
    help="A PEFT LoRA adapter folder to serve as NAME (requests ask for MODEL:NAME); repeatable.",
)
def export(
    model,
    model_option,
    output,
    force,
    max_context,
    quantize,
    block_size,
    symmetric,
    algorithm,
    keep_int8,
    calibration,
    embedding_bits,
    no_quality,
    dtype,
    no_fuse,
    stream,
    graphs,
    prefill_length,
    static_context,
    task,
    pooling,
    matryoshka,
    adapters,
):
    """Export MODEL (a folder, a .gguf file, a catalog name or a hub id) to ONNX: one graph for prefill and decode, or
    (--graphs split) a prefill graph and a decode graph."""
    model = one_model(model, model_option)
    exporter = _exporter()
    settings = dict(
        symmetric=symmetric, algorithm=algorithm, keep_int8=keep_int8, calibration=calibration, embedding_bits=embedding_bits
    )
    if not quantize:
        _refuse_quantization_flags(**settings, no_quality=no_quality)
    quantization = _quantization(exporter, quantize, block_size, **settings) if quantize else None
    options = exporter.ExportOptions(
        force=force,
        max_context=max_context,
        quantization=quantization,
        quality=not no_quality,
        fuse=not no_fuse,
        stream=stream,
        dtype=dtype,
        graphs=graphs,
        prefill_length=prefill_length,
        static_context=static_context,
        adapters=tuple(_adapter_option(a) for a in adapters),
        task=task,
        pooling=pooling,
        matryoshka=_widths(matryoshka),
    )
    manifest = exporter.export_model(model, output, options, say, live=live_stream())
    say(f"exported {manifest.source} ({manifest.architecture}, {_layers_text(manifest.kv)}) to {output}")


def _pictures_text(vision: dict) -> str:
    """What a picture becomes, in one line (the manifest's vision section)."""
    tiles, grid = vision.get("tiles"), vision.get("grid")
    if grid:
        step = vision["steps"][-1]
        read = f"at their own shape, {step['min_pixels']:,} to {step['max_pixels']:,} pixels, a token each {grid}x{grid} square"
    else:
        side = f"{tiles['size']}x{tiles['size']} tiles and the whole picture as one more" if tiles else "one square"
        read = f"as {side}, {vision['tokens_per_image']} tokens each"
    return (
        f"pictures: read {read} ({vision['graph']['file']}); --image FILE with run, /image FILE in chat, image parts through every API"
    )


def _layers_text(kv) -> str:
    """The layers of an export, as its last line says: how many, which keep a state or a window."""
    stateful = len({entry["layer"] for entry in kv.state})
    if stateful and not kv.num_layers:
        text = f"{stateful} layers with a recurrent state, no attention"
    else:
        text = f"{kv.num_layers} attention layers and {stateful} with a recurrent state" if stateful else f"{kv.num_layers} layers"
    windows = [w for w in kv.windows if w > 0]
    if windows:
        text += f", {len(windows)} of them keeping only their {'/'.join(map(str, sorted(set(windows))))}-token window"
    return text


def _quantization(exporter, method: str, block_size: int, keep_int8: str | None, embedding_bits: str | None, **settings):
    """--quantize's settings as export takes them (--keep-int8 a tuple of names, none as empty)."""
    kept = None if keep_int8 is None else tuple(n.strip() for n in keep_int8.split(",") if n.strip() and n.strip() != "none")
    bits = {} if embedding_bits is None else {"embedding_bits": int(embedding_bits)}
    return exporter.Quantization(method, block_size, keep_int8=kept, **bits, **settings)


def _refuse_quantization_flags(**flags) -> None:
    """The flags that shape quantized weights, given without --quantize, are a usage error."""
    given = [f"--{name.replace('_', '-')}" for name, value in flags.items() if value]
    if given:
        raise click.UsageError(f"{given[0]} applies to quantized weights: add --quantize int4 or int8")


def _widths(text: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip()) if text else ()
    except ValueError:
        raise click.BadParameter(f"takes widths separated by commas (64,128,256), got {text!r}", param_hint="--matryoshka") from None


def _adapter_option(value: str) -> tuple[str, str]:
    name, _, folder = value.partition("=")
    if not name or not folder:
        raise click.UsageError(f"--adapter takes NAME=DIR (a name and a PEFT adapter folder), got {value!r}")
    return name, folder


@cli.command("export-adapter")
@click.argument("adapter", type=click.Path())
@click.option("--base", required=True, type=click.Path(), help="The export folder to add the adapter to.")
@click.option("--name", required=True, help="The adapter's name: requests ask for BASE:NAME.")
@click.option("--model", default=None, help="The PyTorch model the export came from, for the check [default: the manifest's source].")
def export_adapter(adapter, base, name, model):
    """Add the PEFT LoRA adapter folder ADAPTER to an existing export, checked against PEFT."""
    manifest = _exporter().export_adapter(adapter, base, name, model, say)
    say(f"added adapter {name} to {base}: it has {', '.join(sorted(manifest.adapters))}")


@cli.command()
@click.argument("prompt")
@with_options(MODEL_OPTIONS)
@with_options(GENERATION_OPTIONS)
@click.option(
    "--chat/--raw",
    default=None,
    help="--chat sends PROMPT as a user's message through the model's chat template; --raw sends it as it is, to be "
    "continued [default: --chat where the model has a chat template].",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON result (text, tokens, timings, finish reason) instead of streaming."
)
@click.option(
    "--tools",
    "tools_file",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="OpenAI function tools (a JSON list) the reply may call.",
)
@click.option("--tool-choice", default=None, help="With --tools: auto, none, required, or a tool's name [default: auto].")
@click.option("--parallel-tool-calls", is_flag=True, help="With --tools: let one reply make several calls [default: one].")
@click.option(
    "--image",
    "images",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    metavar="FILE",
    help="A picture (PNG, JPEG, WebP, GIF, BMP) sent before PROMPT, for a vision-language model; repeat for several.",
)
def run(
    prompt,
    model,
    provider,
    threads,
    max_context,
    memory_limit,
    prefix_cache,
    draft,
    chat_template,
    chat,
    as_json,
    tools_file,
    tool_choice,
    parallel_tool_calls,
    images,
    **params,
):
    """Answer PROMPT (`-` reads it from stdin), streaming the reply as it is produced: through the
    model's chat template where it has one, else (or with --raw) continuing PROMPT's text."""
    settings = generation_settings(params, draft)
    prompt = sys.stdin.read().rstrip("\n") if prompt == "-" else prompt
    if (tools_file or tool_choice or parallel_tool_calls) and chat is False:
        raise click.UsageError("--tools, --tool-choice and --parallel-tool-calls apply to a chat turn: leave out --raw")
    if (tool_choice or parallel_tool_calls) and not tools_file:
        raise click.UsageError("--tool-choice and --parallel-tool-calls need --tools")
    if images and chat is False:
        raise click.UsageError("--image goes with a chat turn (the template places the picture): leave out --raw")
    engine = load_engine(model, provider, threads, max_context, memory_limit, prefix_cache, draft=draft, chat_template=chat_template)
    asked = [user_message(prompt, images)]
    if tools_file:
        return _run_with_tools(engine, asked, tools_file, (tool_choice, parallel_tool_calls), as_json, settings)
    if chat is None:
        chat = engine.tokenizer.chat_template is not None or bool(images)
    if as_json:
        result = engine.chat(asked, **settings) if chat else engine.generate(prompt, **settings)
        payload = {"model": engine.manifest.source, "provider": engine.provider, **dataclasses.asdict(result)}
        click.echo(json.dumps(payload, ensure_ascii=False))
        return
    say_timings(_streamed_chat(engine, asked, settings) if chat else _streamed(engine, prompt, settings))


def _streamed(engine, prompt: str, settings: dict):
    """PROMPT's continuation on stdout as it comes; its last piece."""
    for piece in engine.stream(prompt, **settings):
        click.echo(piece.text, nl=False)
        sys.stdout.flush()
    click.echo()
    return piece


def _streamed_chat(engine, asked: list[dict], settings: dict):
    """The reply to the messages `asked` on stdout as it comes (a reasoning model's thought on stderr); its result."""
    for delta in engine.stream_chat(asked, **settings):
        if delta.reasoning:
            click.echo(delta.reasoning, nl=False, err=True)
        click.echo(delta.text, nl=False)
        sys.stdout.flush()
    click.echo()
    return delta.result


def _run_with_tools(engine, messages: list[dict], tools_file: str, asked: tuple, as_json: bool, settings: dict) -> None:
    """One chat turn of `messages` with tools (`asked`: --tool-choice, --parallel-tool-calls): the
    reply's text, then each call as a JSON line {"name", "arguments"}."""
    tool_choice, parallel = asked
    try:
        tools = json.loads(Path(tools_file).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"{tools_file} is not JSON ({e}): give a JSON list of OpenAI function tools", param_hint="--tools")
    named = tool_choice not in (None, "auto", "none", "required")
    choice = {"type": "function", "function": {"name": tool_choice}} if named else tool_choice
    result = engine.chat(messages, tools=tools, tool_choice=choice, parallel_tool_calls=parallel, **settings)
    if as_json:
        payload = {"model": engine.manifest.source, "provider": engine.provider, **dataclasses.asdict(result)}
        click.echo(json.dumps(payload, ensure_ascii=False))
        return
    if result.text:
        click.echo(result.text)
    for call in result.tool_calls:
        click.echo(json.dumps({"name": call.name, "arguments": json.loads(call.arguments)}, ensure_ascii=False))
    if result.cut_tool_call is not None:
        say(f"the reply ended inside a call to {result.cut_tool_call.name}, not printed: give a larger --max-new-tokens")
    say(f"finish: {result.finish_reason}, tool format: {result.tool_format}")


@cli.command()
@model_argument
@click.option("--architectures", is_flag=True, help="List the model families edgeinfer can export.")
@click.option("--json", "as_json", is_flag=True, help="Print the export's manifest (JSON) instead.")
def info(model, model_option, architectures, as_json):
    """Print what MODEL's export holds (an export folder or a catalog name: what it is, memory,
    graphs, adapters) and the execution providers usable here; --json its manifest; or
    (--architectures) the model families edgeinfer can export."""
    if architectures:
        return _architectures()
    if model is None and model_option is None:
        raise click.UsageError("give a MODEL (an export folder or a catalog name), or --architectures")
    folder = resolve_export(one_model(model, model_option), say)
    from edgeinfer.sdk.manifest import load_manifest
    from edgeinfer.sdk.memory import MemoryPlan, size_text
    from edgeinfer.sdk.runtime import cuda_unusable_reason

    manifest = load_manifest(folder)
    if as_json:
        click.echo(json.dumps(manifest.to_dict(), indent=2))
        return
    plan = MemoryPlan.of(manifest, manifest.max_context, 1)
    click.echo(
        f"{manifest.source}: {manifest.architecture}, {_layers_text(manifest.kv)}, context {manifest.max_context} tokens, "
        f"{manifest.precision}, in {folder}"
    )
    if manifest.task == "embedding":
        embedding = manifest.embedding
        click.echo(
            f"embedding model: {embedding['dimensions']} dimensions, {embedding['pooling']} pooling"
            + (", normalized" if embedding["normalize"] else "")
            + f"; weights {size_text(plan.weights)}; Engine.load(...).embed(texts), or POST /v1/embeddings under edgeinfer serve"
        )
        return
    click.echo(
        f"memory: weights {size_text(plan.weights)}, KV cache {size_text(plan.kv_per_token)} per token and row, "
        f"{size_text(plan.kv)} for the whole context of {manifest.max_context} tokens"
    )
    _describe_graphs(manifest, plan)
    if manifest.vision:
        click.echo(_pictures_text(manifest.vision))
    cuda = cuda_unusable_reason()
    click.echo(f"providers: cpu: usable; cuda: {'usable' if cuda is None else 'not usable (' + cuda + ')'}")


def _architectures() -> None:
    from edgeinfer.export.families import TESTED, UNSUPPORTED, VISION_LANGUAGE

    click.echo("tested (each proven by a parity test against transformers):")
    click.echo("  " + ", ".join(TESTED))
    click.echo("vision-language, with their vision encoder (pictures through the SDK, run --image and every API):")
    click.echo("  " + ", ".join(VISION_LANGUAGE))
    click.echo("others: any decoder-only causal language model transformers has is tried; the export's checks")
    click.echo("  against PyTorch decide, and a failure names its stage (docs/models.md lists the families tried)")
    click.echo("not supported:")
    for name, reason in UNSUPPORTED.items():
        click.echo(f"  {name}: {reason}")


def _describe_graphs(manifest, plan) -> None:
    """info's lines on the prefix cache, the graphs, speculative decoding and the adapters."""
    from edgeinfer.sdk.engine import DEFAULT_PREFIX_CACHE_MIB

    tokens = DEFAULT_PREFIX_CACHE_MIB * 2**20 // plan.kv_per_token
    click.echo(
        f"prefix cache: {DEFAULT_PREFIX_CACHE_MIB} MiB by default, {tokens} tokens of prompts "
        "(--prefix-cache MIB; hits, misses and bytes held in edgeinfer serve's /metrics)"
    )
    if manifest.layout == "split":
        click.echo(
            f"graphs: split, {manifest.prefill.file} ({manifest.prefill_length or 'any number of'} positions) and "
            f"{manifest.graph.file} ("
            + (f"a cache of {manifest.static_context} slots, one token a pass)" if manifest.static_context else "any shapes)")
        )
    else:
        click.echo(f"graphs: single, {manifest.graph.file} for prefill and decode")
    if "logits_to_keep" in manifest.graph.inputs:
        click.echo("speculative decoding: yes (--speculative prompt-lookup, or --draft MODEL)")
    else:
        click.echo("speculative decoding: no, the graph gives the last position's logits only (export it again)")
    if manifest.adapters:
        click.echo(f"LoRA adapters: {', '.join(sorted(manifest.adapters))} (--adapter NAME; MODEL:NAME under edgeinfer serve)")


@cli.command()
@model_argument
def verify(model, model_option):
    """Check every file of MODEL's export (a folder or a catalog name) against the size and SHA-256
    its manifest records. Exits 1, naming the file, where one differs."""
    from edgeinfer.sdk.manifest import load_manifest, verify_files

    folder = resolve_export(one_model(model, model_option), say)
    from edgeinfer.sdk.memory import size_text

    manifest = load_manifest(folder)
    checked = verify_files(Path(folder), manifest.files)
    click.echo(f"verified {len(manifest.files)} files ({size_text(checked)}) of {folder}: all match the manifest")


@cli.command()
@model_argument
@click.option("--against", "source", required=True, help="The model it was exported from: folder, .gguf, catalog name or hub id.")
@click.option("--prompt", default=None, help="Text to check with [default: a fixed sentence].")
@click.option("--new-tokens", default=16, show_default=True, type=click.IntRange(1, 4096))
def check(model, model_option, source, prompt, new_tokens):
    """Check MODEL's export (a folder or a catalog name) against its PyTorch source: greedy tokens,
    prefill and decode logits, those of several tokens in one pass (extend), and a batch of two
    prompts against single runs. A quantized export's tokens and logits differ from fp32's by
    design: its quality (top-1 agreement, perplexity) is measured again and held to what its
    manifest recorded. Exits 1 if any differs."""
    _exporter()  # a clear error where the export extra is missing
    from edgeinfer.export.check import DEFAULT_PROMPT, check_export
    from edgeinfer.export.source import load_model, resolve_source
    from edgeinfer.sdk.manifest import load_manifest

    folder = resolve_export(one_model(model, model_option), say)
    source_model, _ = load_model(resolve_source(source, say), with_tokenizer=False)
    result = check_export(folder, source_model, prompt or DEFAULT_PROMPT, new_tokens)
    same = {True: "equal", False: "DIFFERENT"}
    click.echo(
        f"greedy tokens ({new_tokens} after a {result.prompt_tokens}-token prompt): {same[result.tokens_equal]} to transformers'"
    )
    if not result.tokens_equal:
        click.echo(f"  transformers: {result.expected_tokens}\n  export:       {result.tokens}")
    for stage in ("prefill", "decode", "extend"):
        difference = getattr(result, f"max_abs_diff_{stage}")
        verdict = "within" if difference <= result.tolerance else "ABOVE"
        click.echo(f"{stage} logits: largest difference {difference:.2e}, {verdict} tolerance {result.tolerance:.2e}")
    click.echo(f"batch of two prompts: rows {same[result.batch_rows_equal_single]} to single runs")
    quantization = load_manifest(folder).quantization or {}
    if quantization.get("method"):  # its logits differ from fp32's by design: its quality is what is checked
        passed = result.batch_rows_equal_single and _quality_kept(folder, source_model, quantization)
    else:
        passed = result.passed
    if not passed:
        raise ExportError(
            f"the export in {folder} does not match {source}: re-export it, and report the check's output if it persists"
        )
    click.echo("check passed")


def _quality_kept(folder, source_model, recorded: dict) -> bool:
    """A quantized export's quality measured again, said beside what its manifest recorded."""
    from edgeinfer.export.check import AGREEMENT_TOLERANCE, PERPLEXITY_TOLERANCE, check_quality

    method = recorded["method"]
    click.echo(f"{method} weights: tokens and logits differ from fp32's by design; the quality is checked instead")
    measured, moved = check_quality(folder, source_model, recorded)
    click.echo(
        f"quality over {measured['text_tokens']} tokens: top-1 agreement with fp32 {measured['top1_agreement']:.1%}, "
        f"perplexity {measured['perplexity']:.2f} (fp32 {measured['perplexity_fp32']:.2f})"
    )
    if "top1_agreement" not in recorded:
        click.echo("  the export did not measure its quality (--no-quality): nothing to hold it to")
    elif moved:
        click.echo(f"  MOVED from the manifest's figures: {'; '.join(moved)}")
    else:
        click.echo(
            f"  as the manifest recorded ({recorded['top1_agreement']:.1%}, {recorded['perplexity']:.2f}): within "
            f"{AGREEMENT_TOLERANCE:.0%} and {PERPLEXITY_TOLERANCE:.0%}"
        )
    return not moved


cli.add_command(chat)
cli.add_command(bench)
cli.add_command(serve)
cli.add_command(list_models)
cli.add_command(pull)
cli.add_command(ps)
cli.add_command(rm)
cli.add_command(info, "show")


def main() -> None:
    debug = "--debug" in sys.argv[1:]
    if not {"-v", "--verbose"} & set(sys.argv[1:]):
        quiet_libraries()
    # A service manager stops a process with SIGTERM: exit through the same clean-up as Ctrl-C
    # (an export removes its temporary folder).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        cli.main(standalone_mode=False, prog_name="edgeinfer")
    except EdgeInferError as e:
        if debug:
            raise
        say(f"error: {in_flags(e)}")
        sys.exit(1)
    except click.exceptions.Abort:
        say("interrupted")
        sys.exit(130)
    except click.ClickException as e:  # a usage error: in the same one-line shape as the others, with where help is
        helped = isinstance(e, click.UsageError) and e.ctx is not None
        say(f"error: {e.format_message()}" + (f" (`{e.ctx.command_path} --help` shows the options)" if helped else ""))
        sys.exit(e.exit_code)
    except OSError as e:  # the file system: permissions, a full disk, a vanished folder
        if debug:
            raise
        say(f"error: {e.strerror or e}{': ' + str(e.filename) if e.filename else ''}")
        sys.exit(1)
