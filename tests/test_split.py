"""The split layout (`edgeinfer export --graphs split`): prefill.onnx and decode.onnx on one
weights file, loaded by the runtime, giving the single graph's tokens and logits; and its shapes
fixed with --prefill-length and --static-context."""

import shutil

import numpy as np
import onnx
import pytest
from conftest import logits_against_transformers

from edgeinfer.export import ExportOptions, export_model
from edgeinfer.export.split import split_export
from edgeinfer.sdk import Engine
from edgeinfer.sdk.errors import ExportError, GenerationError
from edgeinfer.sdk.manifest import load_manifest
from edgeinfer.sdk.scheduler import Scheduler

PROMPTS = ["The capital of France is", "Edge boxes run small language models close to their users, and they"]


@pytest.fixture(scope="module")
def layouts(tiny_llama, tmp_path_factory):
    """The tiny llama's single-graph export, and split ones: shapes dynamic, and shapes fixed."""
    hf, single = tiny_llama
    root = tmp_path_factory.mktemp("split")
    export_model(str(hf), root / "split", ExportOptions(graphs="split"))
    export_model(str(hf), root / "static", ExportOptions(graphs="split", prefill_length=12, static_context=64))
    return {"single": single, "split": root / "split", "static": root / "static"}


def _inputs(path):
    return {
        i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
        for i in onnx.load(str(path), load_external_data=False).graph.input
    }


def test_split_writes_two_graphs_on_one_weights_file(layouts):
    folder = layouts["static"]
    manifest = load_manifest(folder)
    assert sorted(p.name for p in folder.iterdir() if p.suffix in (".onnx", ".data")) == [
        "decode.onnx",
        "prefill.onnx",
        "weights.data",
    ]
    assert manifest.layout == "split" and manifest.format_version == 3
    assert (manifest.prefill.file, manifest.graph.file) == ("prefill.onnx", "decode.onnx")
    assert not any(name.startswith("past_key_values.") for name in manifest.prefill.inputs)
    single_data = (layouts["single"] / "model.onnx.data").stat().st_size
    assert (folder / "weights.data").stat().st_size == single_data  # one copy of the weights, not two
    for graph in ("prefill.onnx", "decode.onnx"):  # every weight both graphs read is in weights.data
        model = onnx.load(str(folder / graph), load_external_data=False)
        locations = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
        assert locations == {"weights.data"}
    prefill, decode = _inputs(folder / "prefill.onnx"), _inputs(folder / "decode.onnx")
    assert prefill["input_ids"][1] == 12 and prefill["attention_mask"][1] == 12
    assert decode["input_ids"][1] == 1 and decode["attention_mask"][1] == 64
    assert all(decode[name][manifest.kv.sequence_axis] == 64 for name in manifest.kv.past)
    assert manifest.max_context == 64 and manifest.validation["split"]["tokens_equal"]
    assert manifest.validation["split"]["max_abs_diff"] <= manifest.validation["split"]["tolerance"]
    # the default layout is unchanged: one graph, the format older versions read
    assert load_manifest(layouts["single"]).format_version == 2 and load_manifest(layouts["single"]).prefill is None


@pytest.mark.parametrize("layout", ["split", "static"])
def test_split_layouts_give_the_single_graphs_tokens_and_logits(layouts, layout):
    single, split = Engine.load(layouts["single"]), Engine.load(layouts[layout])
    assert split.runner.prefill_graph is not None and single.runner.prefill_graph is None
    for prompt in PROMPTS:  # the second is longer than the static prefill graph's 12 positions
        assert (
            split.generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids
            == single.generate(prompt, max_new_tokens=16, ignore_eos=True).token_ids
        )
    ids = single.prompt_ids(PROMPTS[1])
    ours, theirs = [], []
    for engine, out in ((split, ours), (single, theirs)):
        cache = engine.runner.new_batch()
        logits = engine.runner.prefill(cache, [ids]).numpy()[0, -1]
        out.append(logits)
        for _ in range(6):
            logits = engine.runner.decode(cache, [int(np.argmax(logits))]).numpy()[0, -1]
            out.append(logits)
    assert np.abs(np.stack(ours) - np.stack(theirs)).max() <= 1e-4
    short = ["The capital", "Edge"]  # a batch that fits the prefill graph's positions
    assert [r.token_ids for r in split.generate_batch(short, max_new_tokens=8, ignore_eos=True)] == [
        r.token_ids for r in single.generate_batch(short, max_new_tokens=8, ignore_eos=True)
    ]


def test_split_layouts_match_transformers(layouts, tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama[0]).eval()
    engine = Engine.load(layouts["static"])
    ours, reference = logits_against_transformers(engine, model, engine.prompt_ids(PROMPTS[1]))
    assert np.abs(ours - reference).max() <= 1e-3 * max(1.0, np.abs(reference).max())


def test_speculative_decoding_on_a_static_decode_graph_checks_one_token_a_pass(layouts):
    """Its proposals are checked through the decode graph's one-token passes: same tokens."""
    single, static = Engine.load(layouts["single"]), Engine.load(layouts["static"])
    prompt = "Edge boxes run models. Edge boxes run models. Edge boxes"  # fits the 64 slots with 12 more
    plain = single.generate(prompt, max_new_tokens=12, ignore_eos=True).token_ids
    assert static.generate(prompt, max_new_tokens=12, ignore_eos=True, speculative="prompt_lookup").token_ids == plain


def test_a_batch_longer_than_the_fixed_prefill_length_is_refused_with_the_way_out(layouts):
    engine = Engine.load(layouts["static"])
    with pytest.raises(GenerationError, match="prefill-length"):
        engine.generate_batch(PROMPTS, max_new_tokens=2)


@pytest.mark.parametrize("layout", ["split", "static"])
def test_the_scheduler_serves_the_split_layouts(layouts, layout):
    """Dynamic shapes: continuous batching on the decode graph, which takes the prompts' chunks
    too. A static decode graph: one request at a time through the engine's loop."""
    single, static = Engine.load(layouts["single"]), Engine.load(layouts[layout])
    with Scheduler(static, max_batch=4) as scheduler:
        assert ("fixed shapes" in scheduler.mode) == (layout == "static") and scheduler.is_batched == (layout == "split")
        requests = [scheduler.submit(p, max_new_tokens=6, ignore_eos=True) for p in PROMPTS]
        tokens = [r.result().token_ids for r in requests]
    assert tokens == [single.generate(p, max_new_tokens=6, ignore_eos=True).token_ids for p in PROMPTS]


def test_split_options_are_checked_before_any_work(tiny_llama, tmp_path):
    with pytest.raises(ExportError, match="--graphs split"):
        ExportOptions(prefill_length=16)
    with pytest.raises(ExportError, match="unknown graph layout"):
        ExportOptions(graphs="three")
    with pytest.raises(ExportError, match="at least 2"):
        ExportOptions(graphs="split", static_context=1)
    with pytest.raises(ExportError, match="more than --static-context"):
        ExportOptions(graphs="split", prefill_length=64, static_context=32)
    small = export_model(str(tiny_llama[0]), tmp_path / "small", ExportOptions(graphs="split", static_context=4))
    assert small.max_context == 4 and small.validation["split"]["tokens_equal"]  # the export's own check fits 4 slots
    with pytest.raises(ExportError, match="at most 256"):
        export_model(str(tiny_llama[0]), tmp_path / "out", ExportOptions(graphs="split", static_context=1000))
    assert not (tmp_path / "out").exists()


def test_static_context_needs_a_cache_written_in_place(tiny_llama, tmp_path):
    folder = tmp_path / "unfused"
    shutil.copytree(tiny_llama[1], folder)
    manifest = load_manifest(folder)
    with pytest.raises(ExportError, match="--static-context needs a graph that writes its KV cache in place"):
        import dataclasses

        split_export(folder, dataclasses.replace(manifest, kv=dataclasses.replace(manifest.kv, in_place=False)), None, 32)


def test_shared_weights_give_both_sessions_the_same_values(layouts):
    """The GPU's path (runtime.load_weights handed to both sessions), run here on the CPU: the
    values are the weights file's, by name, dtype and shape, so the logits are the same."""
    from edgeinfer.sdk.runtime import Graph, load_weights

    folder = layouts["split"]
    shared = load_weights(folder / "decode.onnx", "cpu")
    assert len(shared) > 5 and sum(v.numpy().nbytes for v in shared.values()) == (folder / "weights.data").stat().st_size
    feed = {"input_ids": np.arange(3, 20)[None], "attention_mask": np.ones((1, 17), np.int64), "logits_to_keep": np.array(1)}
    own = Graph(folder / "prefill.onnx", "cpu", 1).session.run(["logits"], feed)[0]
    taken = Graph(folder / "prefill.onnx", "cpu", 1, shared).session.run(["logits"], feed)[0]
    assert np.array_equal(own, taken) and np.abs(own).max() > 0
    embedding = next(name for name in shared if "embed" in name)  # the session reads the values it was given:
    shared[embedding].update_inplace(np.zeros(shared[embedding].shape(), np.float32))  # zeroed there, its logits change
    assert not np.array_equal(Graph(folder / "prefill.onnx", "cpu", 1, shared).session.run(["logits"], feed)[0], own)
