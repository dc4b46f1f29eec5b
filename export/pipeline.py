"""`edgeinfer export`: a Hugging Face model in, a complete export folder out, or nothing."""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.sdk.errors import ExportError
from edgeinfer.sdk.manifest import (
    ADAPTERS_FORMAT_VERSION,
    KVSpec,
    Manifest,
    describe_files,
)
from edgeinfer.sdk.memory import give_back_freed_memory, map_large_blocks, size_text

from .fp16 import convert_to_fp16
from .fuse import CHECK_PROMPT, CHECK_TOKENS, fuse_graph
from .embedding import CHECK_TEXTS, base_model, pooling_config, torch_embeddings
from .embedding import check as check_embeddings
from .graphs import GRAPH_FILE, export_graph, export_hidden_graph, kv_layout, save_graph
from .lora import PeftAdapter, add_adapters, check_fits, checked_name, peft_reference, read_peft
from .quantize import Quantization, quality, quality_reference, quantize_graph
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
from .families import TESTED, VISION_LANGUAGE
from .split import split_export
from .stream import deferring
from .budget import (
    check_free_space,
    check_memory,
    check_memory_before_load,
    check_memory_streamed,
    defers_weights,
    fp32_weights,
    peak_memory,
    streamed_disk,
)
from .manifest import manifest_of, max_context, save_tokenizer
from .progress import Stages
from .workspace import PARTIAL, clean_leftovers, disk_error, move_into_place
from .validate import EXTEND_TOKENS, sample_ids, torch_reference, validate
from .vision import VISION_BLOCK, check_vision, is_vision, quantize_vision, vision_reference, with_vision

STAGES = (
    "load",
    "export graph",
    "tokenizer",
    "vision",
    "validate",
    "fuse",
    "fp16",
    "quantize",
    "split",
    "images",
    "adapters",
    "write",
)
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
        manifest = _export_into(model, work, options, say, live)
        move_into_place(work, out)
    except OSError as e:
        raise ExportError(disk_error(e, out)) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return manifest


def _export_into(model: str, work: Path, options: ExportOptions, say, live) -> Manifest:
    map_large_blocks()  # process-wide: large buffers freed go back to the system (the export's peak memory)
    if options.task == "embedding":
        return _export_embedding(model, work, options, Stages(say, ["load", "export graph", "tokenizer", "validate", "write"], live))
    wanted = {
        "quantize": bool(options.quantization),
        "fuse": options.fuse,
        "fp16": options.dtype == "fp16",
        "split": options.graphs == "split",
        "adapters": bool(options.adapters),
    }
    adapters = {name: read_peft(folder) for name, folder in options.adapters}  # a bad folder is refused before any work
    source = resolve_source(model, say)
    with _tried(source_model_type(source), say):
        return _export_source(source, work, options, say, live, wanted, adapters)


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


def _export_source(source: Source, work: Path, options: ExportOptions, say, live, wanted: dict, adapters: dict) -> Manifest:
    """Export from a resolved source: streamed where it is large, else loaded whole and traced."""
    wanted["vision"] = wanted["images"] = source_model_type(source) in VISION_LANGUAGE
    streamed = _streams(source, options)
    if streamed is not None:
        return _export_streamed(source, *streamed, work, options, say, live)
    if options.layers is None:
        check_memory_before_load(source_parameters(source))
    stage = Stages(say, [s for s in STAGES if wanted.get(s, True)], live)
    torch_model, manifest, weights = _traced(source, work, options, stage, adapters)
    with stage("validate"):
        stage.progress("PyTorch's logits and tokens for the checks")
        config, references = torch_model.config.get_text_config(), _references(torch_model, work, options, adapters, source.path)
        del torch_model  # every check from here on compares with `references`: ONNX Runtime's weights alone are held
        gc.collect()  # (a model can refer to itself through bound methods)
        give_back_freed_memory()
        validation = _validated(work, references["validate"], stage)
    manifest, quantization = _refined(work, manifest, config, references, options, stage, validation)
    if "vision" in references:
        with stage("images"):  # the graphs as they will run, with an image
            manifest.save(work)
            validation["vision"] = _vision_validated(work, references["vision"], stage, gate=not quantization)
    manifest = dataclasses.replace(manifest, validation=validation, quantization=quantization)
    if adapters:
        with stage("adapters"):
            manifest = _adapters(work, manifest, adapters, references["adapters"], stage)
    return _written(work, manifest, stage, weights)


def _written(work: Path, manifest: Manifest, stage: Stages, weights: int, make: bool = False) -> Manifest:
    """The write stage: the weights still deferred made and written (`make`), the manifest, with
    the export's files, saved in `work`; then the peak memory said."""
    with stage("write"):
        if make:
            stage.progress("the weights left to write, one at a time")
            import onnx

            save_graph(onnx.load(str(work / GRAPH_FILE), load_external_data=False), work, append=True, make=True)
        manifest = dataclasses.replace(manifest, files=describe_files(work))
        manifest.save(work)
    peak = peak_memory()
    if peak:
        stage.say(
            f"peak memory {size_text(peak)}: {peak / weights:.1f}x the {size_text(weights)} of fp32 weights, "
            f"{stage.total:.0f} s in all"
        )
    return manifest


# A model with this many bytes of fp32 weights (about 0.5B parameters) is exported streamed where it can be.
STREAM_FROM = 2**31
STREAMED_STAGES = ("check", "load", "export graph", "tokenizer", "fuse", "quantize", "write")


def _streams(source: Source, options: ExportOptions) -> tuple[Sizes, int, int] | None:
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
    return sizes, layers, config.num_hidden_layers


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


def _export_streamed(source: Source, sizes: Sizes, layers: int, total: int, work: Path, options: ExportOptions, say, live) -> Manifest:
    """Export a large model without its fp32 weights in memory: a copy of its first layers is
    exported and checked against PyTorch first (the check stage, in a scratch folder); then the
    model, loaded in its checkpoint's precision, is traced with its matrices hollow and its weights
    written one at a time (export/stream.py), fused and quantized as the copy was, unchecked."""
    check_memory_streamed(sizes, layers, total, options.quantization)
    check_free_space(work.parent, streamed_disk(sizes, layers, total, options.quantization))
    wanted = {"fuse": options.fuse, "quantize": bool(options.quantization)}
    stage = Stages(say, [s for s in STREAMED_STAGES if wanted.get(s, True)], live)
    with stage("check"):
        checked = _check_copy(source, layers, work / ".check", options, stage)
    with deferring():
        return _streamed_rest(source, work, options, stage, checked)


def _streamed_rest(source: Source, work: Path, options: ExportOptions, stage: Stages, checked: Manifest) -> Manifest:
    """A streamed export's stages after its check copy's. Without calibration to run, its weights
    are deferred (export/stream.py) until they are quantized or written."""
    defer = defers_weights(options.quantization)
    torch_model, manifest, weights = _traced(source, work, options, stage, {}, streamed=True, defer=defer)
    config = torch_model.config
    del torch_model
    gc.collect()
    give_back_freed_memory()
    validation = {
        **checked.validation,
        "checked_on": f"a copy of the first {checked.kv.num_layers} of the model's {config.num_hidden_layers} layers",
    }
    validation.pop("fusion", None)
    if options.fuse:
        with stage("fuse"):
            stage.progress("as the check copy was fused, unchecked")
            validation["fusion"], manifest = fuse_graph(
                work, config, None, manifest, stage.progress, like=checked.validation["fusion"]
            )
            manifest.save(work)
    quantization = {}
    if options.quantization:
        with stage("quantize"):
            stage.progress("with the MatMuls the check copy kept at 8 bits")
            kept = dataclasses.replace(options.quantization, keep_int8=tuple(checked.quantization["keep_int8"]))
            done = quantize_graph(work, kept, head_first=True)
            quantization = {**dataclasses.asdict(done), "quality": "not measured (a streamed export)"}
    manifest = dataclasses.replace(manifest, validation=validation, quantization=quantization)
    return _written(work, manifest, stage, weights, make=defer)


def _check_copy(source: Source, layers: int, folder: Path, options: ExportOptions, stage: Stages) -> Manifest:
    """The manifest of a copy of the model's first `layers` layers, exported with `options` and
    checked against PyTorch in `folder`, which is then removed."""
    stage.progress(f"the model's first {layers} layers, exported as the model will be and checked against PyTorch")
    folder.mkdir()
    try:
        copy = dataclasses.replace(options, layers=layers, stream=False, force=False, quality=False)
        return _export_into(source.path, folder, copy, lambda line: stage.say(f"      check copy: {line.strip()}"), None)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _traced(source: Source, work: Path, options: ExportOptions, stage: Stages, adapters: dict, streamed=False, defer=False):
    """The loaded PyTorch model, the manifest of its traced graph (saved in `work`), and its fp32
    bytes. `streamed`: the model is loaded in its checkpoint's precision (export/stream.py);
    `defer`: its weights deferred."""
    with stage("load"):
        stage.progress(f"reading {Path(source.gguf_file or source.path).name}" + (" in its own precision" if streamed else ""))
        torch_model, tokenizer = load_model(source, layers=options.layers, precision="source" if streamed else "fp32")
        for adapter in adapters.values():
            check_fits(adapter, torch_model)
    weights = fp32_weights(torch_model)
    if not streamed:  # a streamed export checked the disk it needs before its check copy
        check_free_space(work.parent, fp32_weights(torch_model, as_written=True))
        check_memory(weights)
    with stage("export graph"):
        stage.progress("tracing the model with torch.onnx")
        graph = export_graph(torch_model, work, defer=defer)
    with stage("tokenizer"):
        tokenizer_spec = save_tokenizer(torch_model, tokenizer, work)
    context = max_context(torch_model.config.get_text_config(), tokenizer, options.max_context)
    manifest = manifest_of(source.name, torch_model, graph, kv_layout(work, graph), tokenizer_spec, context)
    if is_vision(torch_model.config):
        with stage("vision"):
            stage.progress("tracing the vision encoder and its projector")
            manifest = with_vision(manifest, torch_model, source.path, work)
    manifest.save(work)
    return torch_model, manifest, weights


def _loaded(model: str, stage: Stages):
    """The model's source, its PyTorch model and its tokenizer (an embedding export's load stage)."""
    source = resolve_source(model, stage.say)
    check_memory_before_load(source_parameters(source))
    stage.progress(f"reading {Path(source.gguf_file or source.path).name}")
    return source, *load_model(source)


def _export_embedding(model: str, work: Path, options: ExportOptions, stage: Stages) -> Manifest:
    """An embedding model's export: its hidden states' graph, checked against transformers."""
    with stage("load"):
        source, torch_model, tokenizer = _loaded(model, stage)
        base = base_model(torch_model)
        pooling = pooling_config(None if source.gguf_file else Path(source.path), options.pooling)
    hidden = int(torch_model.config.hidden_size)
    wrong = [d for d in options.matryoshka if isinstance(d, bool) or not isinstance(d, int) or not 0 < d < hidden]
    if wrong:
        raise ExportError(f"--matryoshka widths must be integers from 1 to {hidden - 1} (the model gives {hidden}), got {wrong[0]!r}")
    check_free_space(work.parent, fp32_weights(base, as_written=True))
    with stage("export graph"):
        stage.progress("tracing the model's hidden states with torch.onnx")
        graph = export_hidden_graph(base, work)
    with stage("tokenizer"):
        tokenizer_spec = save_tokenizer(torch_model, tokenizer, work)
    context = max_context(torch_model.config, tokenizer, options.max_context)
    manifest = dataclasses.replace(
        manifest_of(source.name, torch_model, graph, KVSpec(0, 0, 0, "float32", 2, [], []), tokenizer_spec, context),
        format_version=ADAPTERS_FORMAT_VERSION,
        task="embedding",
        embedding={**pooling, "dimensions": hidden, "matryoshka": sorted(set(options.matryoshka))},
    )
    manifest.save(work)
    with stage("validate"):
        stage.progress("each check text's vector against transformers', alone and in a batch")
        reference = torch_embeddings(base, tokenizer, CHECK_TEXTS, pooling["pooling"], pooling["normalize"])
        del torch_model, base
        gc.collect()
        validation = check_embeddings(work, reference)
        stage.say(
            f"{pooling['pooling']} pooling{', normalized' if pooling['normalize'] else ''} ({pooling['from']}); against "
            f"transformers: cosine at least {validation['cosine_min']:.7f} over {validation['texts']} texts, a batch against "
            f"each alone {validation['batch_max_abs_diff']:.1e}"
        )
    with stage("write"):
        manifest = dataclasses.replace(manifest, validation=validation, files=describe_files(work))
        manifest.save(work)
    return manifest


def _validated(work: Path, reference, stage: Stages) -> dict:
    stage.progress("prefill, decode and 4 tokens at once, against PyTorch's")
    validation = validate(reference, work)
    stage.say(
        f"largest logits difference: prefill {validation['max_abs_diff_prefill']:.2e}, "
        f"decode {validation['max_abs_diff_decode']:.2e}, {EXTEND_TOKENS} tokens at once {validation['max_abs_diff_extend']:.2e} "
        f"(tolerance {validation['tolerance']:.2e})"
    )
    return validation


def _vision_validated(work: Path, reference, stage: Stages, gate: bool) -> dict:
    """The export with an image against transformers; a quantized one's logits differ by design:
    recorded, not a pass mark."""
    stage.progress("an image and its question, against transformers' processor and model")
    checked = check_vision(reference, work, gate)
    stage.say(
        f"vision: pixels within {checked['max_abs_diff_pixels']:.1e} of the processor's, prompt ids "
        f"{'equal' if checked['ids_equal'] else 'DIFFERENT'}, largest logits difference {checked['max_abs_diff_logits']:.2e}, "
        f"greedy tokens {'equal' if checked['tokens_equal'] else 'DIFFERENT'}"
    )
    return checked


def _refined(work: Path, manifest: Manifest, config, references: dict, options: ExportOptions, stage: Stages, validation: dict):
    """The optional stages, in order (fuse, fp16, quantize, split), each adding its checks to
    `validation`; returns the manifest and the quantization entry."""
    say = stage.say
    if options.fuse:
        with stage("fuse"):
            fusion, manifest = fuse_graph(work, config, references["check"], manifest, stage.progress)
            manifest.save(work)  # the graph kept may take other inputs and another KV layout
            validation["fusion"] = fusion
            say(
                f"fused: {', '.join(f'{n} x{c}' for n, c in fusion['fused'].items()) or 'nothing'}"
                + (f" (kept the unfused graph: {fusion['skipped']})" if "skipped" in fusion else "")
                + (f" ({fusion['attention']})" if fusion.get("attention") else "")
            )
    if options.dtype == "fp16":
        with stage("fp16"):
            manifest, half = convert_to_fp16(work, references["check"], manifest)
            validation["float16"] = half
            say(
                f"float16: largest logits difference prefill {half['max_abs_diff_prefill']:.2e}, decode "
                f"{half['max_abs_diff_decode']:.2e} (tolerance {half['tolerance']:.2e}); greedy tokens "
                + ("equal PyTorch fp32's" if half["greedy_tokens_equal"] else "differ from PyTorch fp32's")
            )
    quantization = {}
    if options.quantization:
        with stage("quantize"):
            done = quantize_graph(work, options.quantization)
            quantization = {**dataclasses.asdict(done), **_quality(work, references.get("quality"), stage, done.method)}
            if manifest.vision:
                stage.progress("the vision graph's MatMuls to int8")
                quantization["vision"] = quantize_vision(work)
                stage.say(f"vision graph: {quantization['vision']['matmuls']} MatMuls in int8 (blocks of {VISION_BLOCK})")
    if options.graphs == "split":
        with stage("split"):
            manifest, validation["split"] = _split(work, manifest, options, stage)
    return manifest, quantization


def _quality(work: Path, reference, stage: Stages, method: str) -> dict:
    """The quantized export's quality against fp32 over the quality text, said with the time it
    took; without a reference (--no-quality), a note that it was skipped."""
    if reference is None:
        stage.say("quality not measured (--no-quality)")
        return {"quality": "not measured (--no-quality)"}
    stage.progress(f"the quality over {len(reference.ids)} tokens against fp32 (--no-quality skips this)")
    start = time.perf_counter()
    measured = quality(reference, work)
    stage.say(
        f"{method}: top-1 agreement with fp32 {measured['top1_agreement']:.1%} over "
        f"{measured['text_tokens']} tokens, perplexity {measured['perplexity']:.2f} (fp32 {measured['perplexity_fp32']:.2f}); "
        f"in windows of {measured['window']} (llama-perplexity's way) {measured['perplexity_windowed']:.2f} (fp32 "
        f"{measured['perplexity_windowed_fp32']:.2f}); measured in {time.perf_counter() - start:.0f} s (--no-quality skips it)"
    )
    return measured


def _split(work: Path, manifest: Manifest, options: ExportOptions, stage: Stages):
    stage.progress("prefill.onnx and decode.onnx, then their tokens and logits against the one graph's")
    manifest, split = split_export(work, manifest, options.prefill_length, options.static_context)
    stage.say(
        f"split: prefill.onnx ({options.prefill_length or 'any'} positions) and decode.onnx (cache of "
        f"{options.static_context or 'any'} slots) on one weights file; against the one graph: largest logits "
        f"difference {split['max_abs_diff']:.2e}, greedy tokens {'equal' if split['tokens_equal'] else 'differ'}"
    )
    return manifest, split


def _adapters(work: Path, manifest: Manifest, adapters: dict[str, PeftAdapter], references: dict, stage: Stages) -> Manifest:
    stage.progress("the adapters' files and graph, then each adapter's tokens and logits against PEFT's")
    manifest, checks = add_adapters(work, manifest, adapters, references)
    for name, check in checks.items():
        stage.say(adapter_summary(name, manifest.adapters[name], check))
    return manifest


def adapter_summary(name: str, entry: dict, check: dict) -> str:
    worst = max(check["max_abs_diff_prefill"], check["max_abs_diff_decode"], check["max_abs_diff_extend"])
    against = f"(tolerance {check['tolerance']:.2e})" if check["gated"] else "(a quantized base: recorded, not a pass mark)"
    return (
        f"adapter {name}: rank {entry['rank']} on {len(entry['modules'])} modules; against PEFT: largest logits "
        f"difference {worst:.2e} {against}, greedy tokens {'equal' if check['tokens_equal'] else 'differ'}"
    )


def _references(
    model, work: Path, options: ExportOptions, adapters: dict[str, PeftAdapter] | None = None, source_path: str | None = None
) -> dict:
    """PyTorch's side of the checks the export's stages run, computed while the model is loaded
    (each adapter's with PEFT, after the base's)."""
    references = {"validate": torch_reference(model, sample_ids(model.config.get_text_config().vocab_size))}
    if is_vision(model.config):
        references["vision"] = vision_reference(model, source_path)
    if options.fuse or options.dtype == "fp16":
        references["check"] = torch_reference(model, CHECK_PROMPT, CHECK_TOKENS)
    if options.quantization and options.quality:
        references["quality"] = quality_reference(model, work)
    if adapters:
        references["adapters"] = {name: peft_reference(model, a.folder, CHECK_PROMPT, CHECK_TOKENS) for name, a in adapters.items()}
    return references


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
