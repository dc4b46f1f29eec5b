"""`edgeinfer export`: a Hugging Face model in, a complete export folder out, or nothing."""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.sdk.errors import ExportError
from edgeinfer.sdk.manifest import Manifest, describe_files
from edgeinfer.sdk.memory import map_large_blocks

from .budget import check_memory_before_load
from .families import TESTED, VISION_LANGUAGE
from .fuse import CHECK_PROMPT, CHECK_TOKENS
from .lora import add_adapters, check_fits, checked_name, peft_reference, read_peft
from .quantize import Quantization
from .source import (
    Sizes,
    Source,
    check_layers,
    load_model,
    manifest_source,
    resolve_source,
    source_parameters,
    source_model_type,
    source_sizes,
)
from .stages import EMBEDDING, STREAMED, WHOLE, ExportRun, StreamPlan, run_steps
from .workspace import PARTIAL, clean_leftovers, disk_error, move_into_place

DTYPES = ("fp32", "fp16")
TASKS = ("generation", "embedding")
LAYOUTS = ("single", "split")


@dataclass(frozen=True)
class ExportOptions:
    force: bool = False  # replace an existing output folder
    max_context: int | None = None  # tokens the runtime may hold; default: the model's own limit
    quantization: Quantization | None = None  # None: fp32 weights
    quality: bool = True  # with quantization: measure what it cost against fp32 (--no-quality skips it)
    fuse: bool = True  # ONNX Runtime's transformer optimizer, kept only where it checks out
    dtype: str = "fp32"  # or "fp16": weights, activations and KV cache in float16, for GPUs (with --quantize: the activations)
    graphs: str = "single"  # or "split": prefill.onnx and decode.onnx on one weights file (export/split.py)
    prefill_length: int | None = None  # split: the prefill graph's fixed number of positions
    static_context: int | None = None  # split: the decode graph's fixed KV capacity (one token per pass)
    adapters: tuple[tuple[str, str], ...] = ()  # (name, PEFT folder) of each LoRA adapter (export/lora.py)
    task: str = "generation"  # or "embedding": the hidden states of an embedding model (export/embedding.py)
    pooling: str | None = None  # embedding: "last" or "mean" [default: the model's sentence-transformers config]
    matryoshka: tuple[int, ...] = ()  # embedding: the shorter widths the model was trained to give (Matryoshka)
    stream: bool | None = None  # loaded in its checkpoint's precision, checked on a copy of its first layers; None: for large models
    layers: int | None = None  # only the model's first that many layers (a streamed export's check copy)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ExportError(f"unknown dtype {self.dtype!r}: use 'fp32' or 'fp16'")
        if self.graphs not in LAYOUTS:
            raise ExportError(
                f"unknown graph layout {self.graphs!r}: use 'single' (one graph, the default) or 'split' "
                "(prefill.onnx and decode.onnx)"
            )
        for name, least in (("prefill_length", 1), ("static_context", 2)):
            value = getattr(self, name)
            if value is None:
                continue
            flag = "--" + name.replace("_", "-")
            if self.graphs != "split":
                raise ExportError(f"{flag} shapes the split layout's graphs: pass --graphs split with it")
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ExportError(f"{flag} must be an integer of at least {least}, got {value!r}")
        if self.prefill_length and self.static_context and self.prefill_length > self.static_context:
            raise ExportError(
                f"--prefill-length {self.prefill_length} is more than --static-context {self.static_context}: "
                "a prompt must fit the decode graph's cache; pass a shorter prefill length"
            )
        if self.task not in TASKS:
            raise ExportError(f"unknown task {self.task!r}: use 'generation' (the default) or 'embedding'")
        if self.task == "embedding":
            given = [
                flag
                for flag, value in (
                    ("--quantize", self.quantization),
                    ("--dtype fp16", self.dtype == "fp16"),
                    ("--graphs split", self.graphs == "split"),
                    ("--adapter", self.adapters),
                )
                if value
            ]
            if given:
                raise ExportError(f"--task embedding exports fp32 hidden states for now: leave out {', '.join(given)}")
        elif self.pooling is not None or self.matryoshka:
            raise ExportError("--pooling and --matryoshka describe an embedding model: add --task embedding")
        if self.adapters and self.graphs == "split":
            raise ExportError("--adapter needs the default layout: the split layout (--graphs split) takes no adapters")
        names = [checked_name(name) for name, _ in self.adapters]
        if len(set(names)) != len(names):
            raise ExportError(f"two --adapter options are named {max(names, key=names.count)!r}: give each adapter its own name")
        if self.max_context is not None and (
            isinstance(self.max_context, bool) or not isinstance(self.max_context, int) or self.max_context < 2
        ):
            raise ExportError(f"max_context must be an integer of at least 2, got {self.max_context!r}")


def export_model(
    model: str, out: str | Path, options: ExportOptions = ExportOptions(), say=lambda message: None, live=None
) -> Manifest:
    """Export `model` (folder, .gguf, catalog name or hub id) to the folder `out`. `say` gets the
    stages and their results; `live`, a terminal's text stream, gets a progress line redrawn in
    place during each stage (what it is doing, how far, for how long).

    Export sets glibc's mmap threshold to 1 MiB for the rest of the process (`map_large_blocks`):
    large buffers freed go back to the system at once, which keeps the peak memory down.

    Everything is written to a temporary folder beside `out`, which becomes `out` only once
    complete and validated; on any failure nothing is left behind. A temporary folder left by
    an export that was killed is recognised by its dead owner and removed by the next export.
    """
    out = Path(out).expanduser()
    work = out.parent / f".{out.name}{PARTIAL}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        clean_leftovers(out)  # may put back an export that a kill during --force left set aside
        if out.exists() and not options.force:
            raise ExportError(f"{out} already exists: pass --force to replace it, or choose another folder")
        work.mkdir()
    except OSError as e:
        raise ExportError(disk_error(e, out)) from None
    try:
        manifest = export_into(model, work, options, say, live)
        move_into_place(work, out)
    except OSError as e:
        raise ExportError(disk_error(e, out)) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def export_into(model: str, work: Path, options: ExportOptions, say, live) -> Manifest:
    """Export `model` into the empty folder `work`: the flow of steps (export/stages.py) its task
    and size call for, run over one context."""
    map_large_blocks()  # process-wide: large buffers freed go back to the system (the export's peak memory)
    if options.task == "embedding":
        return run_steps(EMBEDDING, ExportRun(model, work, options), say, live)
    adapters = {name: read_peft(folder) for name, folder in options.adapters}  # a bad folder is refused before any work
    source = resolve_source(model, say)
    run = ExportRun(model, work, options, source, adapters, vision=source_model_type(source) in VISION_LANGUAGE)
    with _tried(source_model_type(source), say):
        run.plan = _streams(source, options)
        if run.plan is not None:
            return run_steps(STREAMED, run, say, live)
        if options.layers is None:
            check_memory_before_load(source_parameters(source))
        return run_steps(WHOLE, run, say, live)


@contextmanager
def _tried(model_type: str | None, say):
    """A family the tests do not prove is tried: it is said, and an export that fails says so."""
    if model_type is None or model_type in TESTED or model_type in VISION_LANGUAGE:
        yield
        return
    say(f"model type {model_type!r} is not among the families edgeinfer's tests prove: tried, and the checks against PyTorch decide")
    try:
        yield
    except ExportError as e:
        raise ExportError(
            f"{e} (model type {model_type!r} is not among the families edgeinfer's tests prove; docs/models.md lists how each "
            "family tried came out: report this one with the output of --debug)"
        ) from e


# A model with this many bytes of fp32 weights (about 0.5B parameters) is exported streamed where it can be.
STREAM_FROM = 2**31


def _streams(source: Source, options: ExportOptions) -> StreamPlan | None:
    """The checkpoint's sizes, the check copy's layers and the model's where this export is
    streamed; None where it is not. --stream where it cannot be is refused."""
    from transformers import AutoConfig

    if options.stream is False or options.layers is not None:
        return None
    sizes = source_sizes(source)
    why_not = _not_streamable(options, sizes) or _vision_not_streamed(source)
    if why_not and options.stream:
        raise ExportError(f"--stream cannot export this model: {why_not}; leave --stream out")
    if why_not or (options.stream is None and 4 * sizes.parameters < STREAM_FROM):
        return None
    config = AutoConfig.from_pretrained(source.path)
    layers = check_layers(config)
    if layers >= config.num_hidden_layers:
        return None  # a check copy would be the whole model: it is exported whole and checked as such
    return StreamPlan(sizes, layers, config.num_hidden_layers)


def _not_streamable(options: ExportOptions, sizes: Sizes | None) -> str | None:
    if sizes is None:
        return "it reads safetensors files, and this source has none (a GGUF, or PyTorch .bin files)"
    for flag, given in (("--dtype fp16", options.dtype == "fp16"), ("--graphs split", options.graphs == "split")):
        if given:
            return f"{flag} converts the whole graph in memory"
    if options.adapters:
        return "--adapter checks each adapter on the whole model"
    return None


def _vision_not_streamed(source: Source) -> str | None:
    if source_model_type(source) in VISION_LANGUAGE:
        return "a vision-language model is exported whole (its language model and vision graph checked together)"
    return None


def adapter_summary(name: str, entry: dict, check: dict) -> str:
    worst = max(check["max_abs_diff_prefill"], check["max_abs_diff_decode"], check["max_abs_diff_extend"])
    against = f"(tolerance {check['tolerance']:.2e})" if check["gated"] else "(a quantized base: recorded, not a pass mark)"
    return (
        f"adapter {name}: rank {entry['rank']} on {len(entry['modules'])} modules; against PEFT: largest logits "
        f"difference {worst:.2e} {against}, greedy tokens {'equal' if check['tokens_equal'] else 'differ'}"
    )


def export_adapter(
    adapter_folder: str | Path, base: str | Path, name: str, model: str | None = None, say=lambda message: None
) -> Manifest:
    """Add the PEFT LoRA adapter in `adapter_folder` to the export `base` as `name`, checked against
    PEFT on the PyTorch model the export came from (`model`, default: the manifest's source).

    The export is changed in one step: the new files are written and checked in a folder of links
    beside it, moved in under names the old manifest does not use, and the manifest is replaced
    last; a failure leaves the export as it was."""
    from edgeinfer.sdk.manifest import load_manifest

    base = Path(base).expanduser()
    manifest = load_manifest(base)
    adapter = read_peft(adapter_folder)
    checked_name(name)
    if name in manifest.adapters:
        raise ExportError(f"{base} already has an adapter named {name!r}: pick another --name")
    model = model or manifest_source(manifest.source)
    say(f"loading {model} for PEFT's reference")
    source = resolve_source(model, say)
    torch_model, _ = load_model(source, with_tokenizer=False)
    check_fits(adapter, torch_model)
    reference = peft_reference(torch_model, adapter.folder, CHECK_PROMPT, CHECK_TOKENS)
    del torch_model
    gc.collect()
    work = base.parent / f".{base.name}{PARTIAL}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _link_tree(base, work)
        updated, checks = add_adapters(work, manifest, {name: adapter}, {name: reference})
        if manifest.lora is not None:
            (work / manifest.lora.file).unlink()  # the graph of the adapters before
        updated = dataclasses.replace(updated, files=describe_files(work))
        updated.save(work)
        say(adapter_summary(name, updated.adapters[name], checks[name]))
        for file in (updated.adapters[name]["file"], updated.lora.file):
            os.replace(work / file, base / file)
        os.replace(work / "edgeinfer.json", base / "edgeinfer.json")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if manifest.lora is not None and manifest.lora.file != updated.lora.file:
        (base / manifest.lora.file).unlink(missing_ok=True)
    return updated


def _link_tree(source: Path, target: Path) -> None:
    """`target`: a folder of hard links to `source`'s files (copies across file systems), the
    manifest copied so that writing it leaves `source`'s alone."""
    target.mkdir()
    for path in source.iterdir():
        if not path.is_file():
            continue
        if path.name == "edgeinfer.json":
            shutil.copy2(path, target / path.name)
            continue
        try:
            os.link(path, target / path.name)
        except OSError:
            shutil.copy2(path, target / path.name)
