"""The export's stages as data: each flow (a model loaded whole, a large one streamed, an embedding
model) is a sequence of `Step`s (the stage's name, when it runs, what it does) over one context,
`ExportRun`, run by one loop (`run_steps`). A step reads what earlier steps left in the context
and leaves its own there; the streamed flow reuses the whole flow's steps, which ask the context
whether a check copy (`run.checked`) stands in for the checks against PyTorch."""

from __future__ import annotations

import dataclasses
import gc
import shutil
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from edgeinfer.sdk.errors import ExportError
from edgeinfer.sdk.manifest import ADAPTERS_FORMAT_VERSION, GraphSpec, KVSpec, Manifest, describe_files
from edgeinfer.sdk.memory import give_back_freed_memory, size_text

from .attention import layer_windows
from .budget import (
    check_free_space,
    check_memory,
    calibration_disk,
    check_disk,
    check_memory_streamed,
    fp32_weights,
    peak_memory,
    streamed_disk,
)
from .embedding import CHECK_TEXTS, base_model, pooling_config, torch_embeddings
from .embedding import check as check_embeddings
from .fp16 import convert_to_fp16
from .fuse import CHECK_PROMPT, CHECK_TOKENS, fuse_graph
from .graphs import GRAPH_FILE, export_graph, export_hidden_graph, kv_layout, save_graph
from .lora import add_adapters, check_fits, peft_reference
from .manifest import manifest_of, max_context, save_tokenizer
from .progress import Stages
from .quantize import quality, quality_reference, quantize_graph
from .table import gathered_table
from .budget import check_memory_before_load
from .source import Sizes, Source, load_model, resolve_source, source_parameters
from .split import split_export
from .stream import deferring
from .validate import EXTEND_TOKENS, sample_ids, torch_reference, validate
from .vision import VISION_BLOCK, check_vision, is_vision, quantize_vision, vision_reference, with_vision


@dataclass(frozen=True)
class StreamPlan:
    """A streamed export's checkpoint sizes, the check copy's layers and the model's."""

    sizes: Sizes
    layers: int
    total: int


@dataclass
class ExportRun:
    """One export's context: what it was asked (`model` or its resolved `source`, `work`, the
    options, the adapters) and what its steps leave for the next (the loaded model, the manifest
    as it grows, PyTorch's references, the checks and the quantization they record)."""

    model: str
    work: Path
    options: object  # pipeline.ExportOptions
    source: Source | None = None
    adapters: dict = field(default_factory=dict)
    vision: bool = False  # a vision-language family: its vision graph traced and checked with a picture
    plan: StreamPlan | None = None  # a streamed export's
    checked: Manifest | None = None  # a streamed export's check copy, whose checks stand for the model's
    stage: Stages | None = None
    torch_model: object = None
    tokenizer: object = None
    config: object = None  # the text model's config, kept once the model is let go
    graph: GraphSpec | None = None  # the traced graph's
    manifest: Manifest | None = None
    weights: int = 0  # bytes of fp32 weights (the peak memory is said against them)
    references: dict = field(default_factory=dict)
    validation: dict = field(default_factory=dict)
    quantization: dict = field(default_factory=dict)
    pooling: dict = field(default_factory=dict)  # an embedding model's pooling and where it came from
    activations: object = None  # a streamed export's calibration, taken from PyTorch (calibration.Activations)
    exits: ExitStack = field(default_factory=ExitStack)  # what the flow holds open until its last step

    @property
    def defer(self) -> bool:
        """Whether the weights are made only as they are quantized or written (export/stream.py):
        a streamed export's."""
        return self.plan is not None


@dataclass(frozen=True)
class Step:
    """A stage: its `name` (None: run between stages, unseen), `when` it runs (decided before the
    first step, from what was asked), and `run`, which changes the context."""

    name: str | None
    when: Callable[[ExportRun], bool]
    run: Callable[[ExportRun], None]


def run_steps(steps: tuple[Step, ...], run: ExportRun, say, live) -> Manifest:
    """Run the steps of a flow that apply, each inside its stage ("[i/n] name", its time, a failure
    named with it); then say the peak memory against the fp32 weights."""
    chosen = [step for step in steps if step.when(run)]
    run.stage = Stages(say, [step.name for step in chosen if step.name], live)
    with run.exits:
        for step in chosen:
            if step.name is None:
                step.run(run)
                continue
            with run.stage(step.name):
                step.run(run)
    say_peak(run)
    return run.manifest


def say_peak(run: ExportRun) -> None:
    peak = peak_memory()
    if peak and run.weights:
        run.stage.say(
            f"peak memory {size_text(peak)}: {peak / run.weights:.1f}x the {size_text(run.weights)} of fp32 weights, "
            f"{run.stage.total:.0f} s in all"
        )


def let_go_of_model(run: ExportRun) -> None:
    """Forget the PyTorch model: every check from here on compares with `run.references`."""
    run.torch_model = run.tokenizer = None
    gc.collect()  # (a model can refer to itself through bound methods)
    give_back_freed_memory()


# The steps of a generation model's export.


def check_copy(run: ExportRun) -> None:
    """A streamed export's first stage: a copy of the model's first layers exported as the model will
    be and checked against PyTorch, in a scratch folder then removed; its checks stand for the
    model's. The steps after it may defer the weights."""
    from .pipeline import export_into

    plan, options = run.plan, run.options
    check_memory_streamed(plan.sizes, plan.layers, plan.total)
    check_free_space(run.work.parent, streamed_disk(plan.sizes, plan.layers, plan.total, options.quantization))
    run.stage.progress(f"the model's first {plan.layers} layers, exported as the model will be and checked against PyTorch")
    folder = run.work / ".check"
    folder.mkdir()
    try:
        copy = dataclasses.replace(options, layers=plan.layers, stream=False, force=False, quality=False)
        run.checked = export_into(run.source.path, folder, copy, lambda line: run.stage.say(f"      check copy: {line.strip()}"), None)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    run.exits.enter_context(deferring())


def load(run: ExportRun) -> None:
    """The PyTorch model and its tokenizer: fp32, or, streamed, in its checkpoint's precision
    (export/stream.py); refused where the memory or disk its export needs is not there."""
    streamed = run.plan is not None
    run.stage.progress(f"reading {Path(run.source.gguf_file or run.source.path).name}" + (" in its own precision" if streamed else ""))
    run.torch_model, run.tokenizer = load_model(run.source, layers=run.options.layers, precision="source" if streamed else "fp32")
    for adapter in run.adapters.values():
        check_fits(adapter, run.torch_model)
    run.weights = fp32_weights(run.torch_model)
    run.config = run.torch_model.config.get_text_config()
    if not streamed:  # a streamed export checked the disk it needs before its check copy
        check_free_space(run.work.parent, fp32_weights(run.torch_model, as_written=True))
        check_memory(run.weights)


def trace(run: ExportRun) -> None:
    run.stage.progress("tracing the model with torch.onnx")
    run.graph = export_graph(run.torch_model, run.work, defer=run.defer)


def write_tokenizer(run: ExportRun) -> None:
    """The tokenizer's files, then the manifest of the traced graph (saved in `work`)."""
    model, graph = run.torch_model, run.graph
    tokenizer_spec = save_tokenizer(model, run.tokenizer, run.work)
    kv = kv_layout(run.work, graph)
    text = model.config.get_text_config()
    # a cache that grows with the text: some attention layer keeps every token (not only a window)
    growing = any(window < 0 for window in layer_windows(text, kv.num_layers))
    context = max_context(text, run.tokenizer, run.options.max_context, attention=growing)
    run.manifest = manifest_of(run.source.name, model, graph, kv, tokenizer_spec, context)
    run.manifest.save(run.work)


def trace_vision(run: ExportRun) -> None:
    if is_vision(run.torch_model.config):
        run.stage.progress("tracing the vision encoder and its projector")
        run.manifest = with_vision(run.manifest, run.torch_model, run.source.path, run.work)
        run.manifest.save(run.work)


def check_against_torch(run: ExportRun) -> None:
    """PyTorch's side of every check the export runs, then the model let go, then the graph's
    prefill, decode and extend logits against PyTorch's."""
    run.stage.progress("PyTorch's logits and tokens for the checks")
    run.references = references(run.torch_model, run.work, run.options, run.adapters, run.source.path)
    let_go_of_model(run)
    run.stage.progress("prefill, decode and 4 tokens at once, against PyTorch's")
    run.validation = validate(run.references["validate"], run.work)
    v = run.validation
    run.stage.say(
        f"largest logits difference: prefill {v['max_abs_diff_prefill']:.2e}, decode {v['max_abs_diff_decode']:.2e}, "
        f"{EXTEND_TOKENS} tokens at once {v['max_abs_diff_extend']:.2e} (tolerance {v['tolerance']:.2e})"
    )


def calibrate(run: ExportRun) -> None:
    """A streamed export's calibration (gptq; k_quant given a text): PyTorch runs the text on the
    model as loaded, each linear layer's input kept on disk by its weight's name, for the quantize
    stage; the fp32 graph is never written (export/calibration.py)."""
    from .calibration import collect_from_model
    from .quantize import calibration_ids

    quantization = run.options.quantization
    ids = calibration_ids(run.work, quantization)
    check_disk(run.work.parent, calibration_disk(run.torch_model, quantization.rule.hessian))
    run.stage.progress(f"the calibration text's {len(ids)} tokens through the model in PyTorch, each linear layer's inputs summed")
    run.activations = collect_from_model(run.torch_model, ids, run.work / "calibration", quantization.rule.hessian)


def adopt_checks(run: ExportRun) -> None:
    """A streamed export's checks: its check copy's, said to be (fusion is its own, below)."""
    run.config = run.torch_model.config
    let_go_of_model(run)
    run.validation = {
        **run.checked.validation,
        "checked_on": f"a copy of the first {run.checked.kv.num_layers} of the model's {run.config.num_hidden_layers} layers",
    }
    run.validation.pop("fusion", None)


def fuse(run: ExportRun) -> None:
    """ONNX Runtime's fusions, kept where they check out against PyTorch; streamed, as the check
    copy's were, unchecked."""
    like = run.checked.validation["fusion"] if run.checked else None
    if like is not None:
        run.stage.progress("as the check copy was fused, unchecked")
    fusion, run.manifest = fuse_graph(run.work, run.config, run.references.get("check"), run.manifest, run.stage.progress, like=like)
    run.manifest.save(run.work)  # the graph kept may take other inputs and another KV layout
    run.validation["fusion"] = fusion
    if like is None:
        run.stage.say(
            f"fused: {', '.join(f'{n} x{c}' for n, c in fusion['fused'].items()) or 'nothing'}"
            + (f" (kept the unfused graph: {fusion['skipped']})" if "skipped" in fusion else "")
            + (f" ({fusion['attention']})" if fusion.get("attention") else "")
        )


def to_fp16(run: ExportRun) -> None:
    run.manifest, half = convert_to_fp16(run.work, run.references["check"], run.manifest)
    run.validation["float16"] = half
    run.stage.say(
        f"float16: largest logits difference prefill {half['max_abs_diff_prefill']:.2e}, decode "
        f"{half['max_abs_diff_decode']:.2e} (tolerance {half['tolerance']:.2e}); greedy tokens "
        + ("equal PyTorch fp32's" if half["greedy_tokens_equal"] else "differ from PyTorch fp32's")
    )


def quantize(run: ExportRun) -> None:
    """The MatMuls to 4 bits (some kept at 8), then the quality against fp32; streamed, with the
    MatMuls the check copy kept at 8 bits, unmeasured."""
    asked = run.options.quantization
    if run.checked:
        run.stage.progress("with the MatMuls the check copy kept at 8 bits")
        asked = dataclasses.replace(asked, keep_int8=tuple(run.checked.quantization["keep_int8"]))
    done = quantize_graph(run.work, asked, head_first=run.checked is not None, activations=run.activations)
    measured = {"quality": "not measured (a streamed export)"} if run.checked else measure_quality(run, done.method)
    run.quantization = {**dataclasses.asdict(done), **measured, "embedding": gathered_table(run.work)}
    if run.quantization["embedding"]:
        table = run.quantization["embedding"]
        source = "the lm_head's, tied" if table["blocks"] == "lm_head" else "its own"
        run.stage.say(f"embedding table: its rows gathered from {table['bits']}-bit blocks ({source})")
    if run.manifest.vision:
        run.stage.progress("the vision graph's MatMuls to int8")
        run.quantization["vision"] = quantize_vision(run.work)
        run.stage.say(f"vision graph: {run.quantization['vision']['matmuls']} MatMuls in int8 (blocks of {VISION_BLOCK})")


def measure_quality(run: ExportRun, method: str) -> dict:
    """The quantized export's quality against fp32 over the quality text, said with the time it
    took; without a reference (--no-quality), a note that it was skipped."""
    reference = run.references.get("quality")
    if reference is None:
        run.stage.say("quality not measured (--no-quality)")
        return {"quality": "not measured (--no-quality)"}
    run.stage.progress(f"the quality over {len(reference.ids)} tokens against fp32 (--no-quality skips this)")
    start = time.perf_counter()
    m = quality(reference, run.work)
    run.stage.say(
        f"{method}: top-1 agreement with fp32 {m['top1_agreement']:.1%} over "
        f"{m['text_tokens']} tokens, perplexity {m['perplexity']:.2f} (fp32 {m['perplexity_fp32']:.2f}); "
        f"in windows of {m['window']} (llama-perplexity's way) {m['perplexity_windowed']:.2f} (fp32 "
        f"{m['perplexity_windowed_fp32']:.2f}); measured in {time.perf_counter() - start:.0f} s (--no-quality skips it)"
    )
    return m


def split(run: ExportRun) -> None:
    options = run.options
    run.stage.progress("prefill.onnx and decode.onnx, then their tokens and logits against the one graph's")
    run.manifest, checked = split_export(run.work, run.manifest, options.prefill_length, options.static_context)
    run.validation["split"] = checked
    run.stage.say(
        f"split: prefill.onnx ({options.prefill_length or 'any'} positions) and decode.onnx (cache of "
        f"{options.static_context or 'any'} slots) on one weights file; against the one graph: largest logits "
        f"difference {checked['max_abs_diff']:.2e}, greedy tokens {'equal' if checked['tokens_equal'] else 'differ'}"
    )


def check_images(run: ExportRun) -> None:
    """The graphs as they will run, with a picture, against transformers; a quantized export's
    logits differ by design: recorded, not a pass mark."""
    if "vision" not in run.references:
        return
    run.manifest.save(run.work)
    run.stage.progress("an image and its question, against transformers' processor and model")
    c = check_vision(run.references["vision"], run.work, gate=not run.quantization)
    run.validation["vision"] = c
    run.stage.say(
        f"vision: pixels within {c['max_abs_diff_pixels']:.1e} of the processor's, prompt ids "
        f"{'equal' if c['ids_equal'] else 'DIFFERENT'}, largest logits difference {c['max_abs_diff_logits']:.2e}, "
        f"greedy tokens {'equal' if c['tokens_equal'] else 'DIFFERENT'}"
    )


def add_lora(run: ExportRun) -> None:
    from .pipeline import adapter_summary

    run.stage.progress("the adapters' files and graph, then each adapter's tokens and logits against PEFT's")
    run.manifest = dataclasses.replace(run.manifest, validation=run.validation, quantization=run.quantization)
    run.manifest, checks = add_adapters(run.work, run.manifest, run.adapters, run.references["adapters"])
    for name, check in checks.items():
        run.stage.say(adapter_summary(name, run.manifest.adapters[name], check))


def write(run: ExportRun) -> None:
    """The weights still deferred made and written, then the manifest, with the export's checks and
    files, saved in `work`."""
    if run.defer:
        import onnx

        run.stage.progress("the weights left to write, one at a time")
        save_graph(onnx.load(str(run.work / GRAPH_FILE), load_external_data=False), run.work, append=True, make=True)
    manifest = dataclasses.replace(run.manifest, validation=run.validation, quantization=run.quantization)
    run.manifest = dataclasses.replace(manifest, files=describe_files(run.work))
    run.manifest.save(run.work)


def references(model, work: Path, options, adapters: dict | None = None, source_path: str | None = None) -> dict:
    """PyTorch's side of the checks the export's stages run, computed while the model is loaded
    (each adapter's with PEFT, after the base's)."""
    found = {"validate": torch_reference(model, sample_ids(model.config.get_text_config().vocab_size))}
    if is_vision(model.config):
        found["vision"] = vision_reference(model, source_path)
    if options.fuse or options.dtype == "fp16":
        found["check"] = torch_reference(model, CHECK_PROMPT, CHECK_TOKENS)
    if options.quantization and options.quality:
        found["quality"] = quality_reference(model, work)
    if adapters:
        found["adapters"] = {name: peft_reference(model, a.folder, CHECK_PROMPT, CHECK_TOKENS) for name, a in adapters.items()}
    return found


# The steps of an embedding model's export.


def load_embedding(run: ExportRun) -> None:
    """The model's source, its PyTorch model and tokenizer, its pooling; its --matryoshka widths checked."""
    run.source = resolve_source(run.model, run.stage.say)
    check_memory_before_load(source_parameters(run.source))
    run.stage.progress(f"reading {Path(run.source.gguf_file or run.source.path).name}")
    run.torch_model, run.tokenizer = load_model(run.source)
    run.pooling = pooling_config(None if run.source.gguf_file else Path(run.source.path), run.options.pooling)
    hidden = int(run.torch_model.config.hidden_size)
    wrong = [d for d in run.options.matryoshka if isinstance(d, bool) or not isinstance(d, int) or not 0 < d < hidden]
    if wrong:
        raise ExportError(f"--matryoshka widths must be integers from 1 to {hidden - 1} (the model gives {hidden}), got {wrong[0]!r}")
    check_free_space(run.work.parent, fp32_weights(base_model(run.torch_model), as_written=True))


def trace_hidden(run: ExportRun) -> None:
    run.stage.progress("tracing the model's hidden states with torch.onnx")
    run.graph = export_hidden_graph(base_model(run.torch_model), run.work)


def write_embedding_tokenizer(run: ExportRun) -> None:
    """The tokenizer's files, then the manifest of the hidden states' graph (saved in `work`)."""
    model, graph, pooling = run.torch_model, run.graph, run.pooling
    tokenizer_spec = save_tokenizer(model, run.tokenizer, run.work)
    context = max_context(model.config, run.tokenizer, run.options.max_context)
    hidden = int(model.config.hidden_size)
    run.manifest = dataclasses.replace(
        manifest_of(run.source.name, model, graph, KVSpec(0, 0, 0, "float32", 2, [], []), tokenizer_spec, context),
        format_version=ADAPTERS_FORMAT_VERSION,
        task="embedding",
        embedding={**pooling, "dimensions": hidden, "matryoshka": sorted(set(run.options.matryoshka))},
    )
    run.manifest.save(run.work)


def check_embeddings_against_torch(run: ExportRun) -> None:
    pooling = run.pooling
    run.stage.progress("each check text's vector against transformers', alone and in a batch")
    reference = torch_embeddings(base_model(run.torch_model), run.tokenizer, CHECK_TEXTS, pooling["pooling"], pooling["normalize"])
    let_go_of_model(run)
    run.validation = check_embeddings(run.work, reference)
    run.stage.say(
        f"{pooling['pooling']} pooling{', normalized' if pooling['normalize'] else ''} ({pooling['from']}); against "
        f"transformers: cosine at least {run.validation['cosine_min']:.7f} over {run.validation['texts']} texts, a batch "
        f"against each alone {run.validation['batch_max_abs_diff']:.1e}"
    )


# The flows.


def always(run: ExportRun) -> bool:
    return True


def asked(option: str, value=True) -> Callable[[ExportRun], bool]:
    """Runs where the option was given (as `value`, where one is named)."""
    return lambda run: (getattr(run.options, option) == value) if value is not True else bool(getattr(run.options, option))


WHOLE = (
    Step("load", always, load),
    Step("export graph", always, trace),
    Step("tokenizer", always, write_tokenizer),
    Step("vision", lambda run: run.vision, trace_vision),
    Step("validate", always, check_against_torch),
    Step("fuse", asked("fuse"), fuse),
    Step("fp16", asked("dtype", "fp16"), to_fp16),
    Step("quantize", asked("quantization"), quantize),
    Step("split", asked("graphs", "split"), split),
    Step("images", lambda run: run.vision, check_images),
    Step("adapters", asked("adapters"), add_lora),
    Step("write", always, write),
)
# A large model: checked on a copy of its first layers, then loaded in its checkpoint's precision
# and written weight by weight, fused and quantized as the copy was.
STREAMED = (
    Step("check", always, check_copy),
    Step("load", always, load),
    Step("export graph", always, trace),
    Step("tokenizer", always, write_tokenizer),
    Step("calibrate", lambda run: bool(run.options.quantization and run.options.quantization.calibrated), calibrate),
    Step(None, always, adopt_checks),
    Step("fuse", asked("fuse"), fuse),
    Step("quantize", asked("quantization"), quantize),
    Step("write", always, write),
)
EMBEDDING = (
    Step("load", always, load_embedding),
    Step("export graph", always, trace_hidden),
    Step("tokenizer", always, write_embedding_tokenizer),
    Step("validate", always, check_embeddings_against_torch),
    Step("write", always, write),
)
