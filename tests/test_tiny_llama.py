"""Export and generation on a tiny random-weight llama, pinned against transformers."""

import collections
import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from edgeinfer import Engine
from edgeinfer.export import export_model
from edgeinfer.sdk.errors import ExportError

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def hf(tiny_llama):
    folder = tiny_llama[0]
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.load(tiny_llama[1], provider="cpu")


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def test_export_writes_one_graph_and_the_manifest(tiny_llama):
    folder = tiny_llama[1]
    manifest = json.loads((folder / "edgeinfer.json").read_text())
    assert manifest["format_version"] == 2
    assert (manifest["architecture"], manifest["kv"]["num_layers"], manifest["kv"]["num_kv_heads"], manifest["kv"]["head_size"]) == (
        "llama",
        2,
        2,
        16,
    )
    assert (manifest["vocab_size"], manifest["max_context"], manifest["bos_token_id"], manifest["eos_token_ids"]) == (320, 256, 1, [])
    assert manifest["validation"]["passed"] and manifest["validation"]["max_abs_diff_decode"] < 1e-4
    assert set(manifest["files"]) == {
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
        "model.onnx",
        "model.onnx.data",
    }
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    past = [f"past_key_values.{layer}.{kind}" for layer in range(2) for kind in ("key", "value")]
    assert manifest["kv"]["in_place"]  # GroupQueryAttention rotates by each row's slots: no position ids
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask", *past, "logits_to_keep"]
    assert [o.name for o in graph.output] == ["logits", *(p.replace("past_key_values", "present") for p in past)]
    logits = graph.output[0].type.tensor_type.shape.dim
    assert (logits[1].dim_param, logits[2].dim_value) == ("logits_to_keep", 320)  # the last positions only
    assert manifest["kv"]["past"] == past and manifest["kv"]["present"] == [p.replace("past_key_values", "present") for p in past]


def test_export_fuses_the_graph_and_no_fuse_keeps_the_traced_one(tiny_llama, tmp_path):
    from edgeinfer.export import ExportOptions

    manifest = json.loads((tiny_llama[1] / "edgeinfer.json").read_text())
    assert manifest["validation"]["fusion"] == {"fused": {"GroupQueryAttention": 2, "SkipSimplifiedLayerNormalization": 4}}
    ops = collections.Counter(n.op_type for n in onnx.load(str(tiny_llama[1] / "model.onnx"), load_external_data=False).graph.node)
    assert ops["GroupQueryAttention"] == 2 and ops["MatMul"] == 2 * 4 + 1  # q, k and v packed, and gate and up, per layer
    assert ops["Split"] == 2  # the packed gate and up projection split back
    assert "Concat" not in ops and "Softmax" not in ops  # no cache concatenation, no attention chain left
    export_model(str(tiny_llama[0]), tmp_path / "plain", ExportOptions(fuse=False))
    plain = onnx.load(str(tmp_path / "plain" / "model.onnx"), load_external_data=False).graph
    assert not any(n.domain == "com.microsoft" for n in plain.node)
    plain_manifest = json.loads((tmp_path / "plain" / "edgeinfer.json").read_text())
    assert "fusion" not in plain_manifest["validation"] and not plain_manifest["kv"]["in_place"]
    prompt = "The capital of France is"
    assert (
        Engine.load(tmp_path / "plain", provider="cpu").generate(prompt, max_new_tokens=16).token_ids
        == Engine.load(tiny_llama[1], provider="cpu").generate(prompt, max_new_tokens=16).token_ids
    )


def test_greedy_tokens_equal_transformers(engine, hf):
    model, tokenizer = hf
    ids = tokenizer(PROMPT).input_ids
    result = engine.generate(PROMPT, max_new_tokens=32)
    assert result.token_ids == hf_greedy(model, ids, 32)
    assert result.finish_reason == "length" and result.prompt_tokens == len(ids)
    assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert result.ttft_s > 0 and result.decode_tokens_per_s > 0


def test_token_id_prompt_gives_the_same_tokens(engine, hf):
    ids = hf[1](PROMPT).input_ids
    assert engine.generate(ids, max_new_tokens=12).token_ids == engine.generate(PROMPT, max_new_tokens=12).token_ids


def test_logits_match_pytorch_at_every_step(engine, hf):
    model = hf[0]
    ids = hf[1](PROMPT).input_ids
    cache = engine.runner.new_batch()
    logits = engine.runner.prefill(cache, [ids]).numpy()
    with torch.no_grad():
        ref = model(torch.tensor([ids]), use_cache=True)
    assert logits.shape == (1, 1, 320)
    np.testing.assert_allclose(logits[0, -1], ref.logits[0, -1].numpy(), atol=1e-4)
    past = ref.cache
    for _ in range(8):
        token = int(np.argmax(logits[0, -1]))
        logits = engine.runner.decode(cache, [token]).numpy()
        with torch.no_grad():
            ref = model(torch.tensor([[token]]), cache=past, use_cache=True)
        past = ref.cache
        np.testing.assert_allclose(logits[0, -1], ref.logits[0, -1].numpy(), atol=1e-4)
    assert int(cache.cache.lengths.max()) == len(ids) + 8


def test_kv_cache_is_written_in_place_on_the_device(engine):
    batch = engine.runner.new_batch(1, 12)
    engine.runner.prefill(batch, [[5, 6, 7]])
    buffers = dict(batch.cache.buffers)
    engine.runner.decode(batch, [8])
    assert list(batch.cache.buffers) == engine.manifest.kv.past
    assert all(batch.cache.buffers[name] is buffers[name] for name in buffers)  # the same buffers, not new outputs
    assert all(isinstance(v, ort.OrtValue) and v.device_name() == "cpu" for v in batch.cache.buffers.values())
    assert [v.shape() for v in batch.cache.buffers.values()] == [[1, 2, 12, 16]] * 4
    assert int(batch.cache.lengths.max()) == 4
    # the step wrote slot 3 and nothing else: mark slots 4.. beforehand and compare
    batch = engine.runner.new_batch(1, 12)
    engine.runner.prefill(batch, [[5, 6, 7]])
    keys = batch.cache.buffers["past_key_values.0.key"].numpy()  # a view of the buffer on the CPU
    keys[0, :, 3:] = 7.0
    before = keys.copy()
    engine.runner.decode(batch, [8])
    after = batch.cache.buffers["past_key_values.0.key"].numpy()
    assert np.array_equal(after[0, :, :3], before[0, :, :3]) and np.all(after[0, :, 4:] == 7.0)
    assert not np.any(after[0, :, 3] == 7.0)


def test_streamed_tokens_are_transformers_and_the_text_is_their_decode(engine, hf):
    model, tokenizer = hf
    pieces = list(engine.stream(PROMPT, max_new_tokens=20))
    tokens = [t for p in pieces for t in p.token_ids]
    assert tokens == hf_greedy(model, tokenizer(PROMPT).input_ids, 20)
    assert "".join(p.text for p in pieces) == tokenizer.decode(tokens, skip_special_tokens=True)
    assert [p.finish_reason for p in pieces][-1] == "length" and all(p.finish_reason is None for p in pieces[:-1])


def test_eos_from_the_manifest_ends_generation(engine, tiny_llama, tmp_path):
    tokens = engine.generate(PROMPT, max_new_tokens=10).token_ids
    eos = tokens[5]
    folder = tmp_path / "eos"
    shutil.copytree(tiny_llama[1], folder)
    manifest = json.loads((folder / "edgeinfer.json").read_text())
    manifest["eos_token_ids"] = [eos]
    (folder / "edgeinfer.json").write_text(json.dumps(manifest))
    result = Engine.load(folder, provider="cpu").generate(PROMPT, max_new_tokens=10)
    assert result.finish_reason == "eos"
    assert result.token_ids == tokens[: tokens.index(eos)]


def test_chat_prompt_uses_the_models_template(engine, hf):
    messages = [{"role": "user", "content": "Hello there"}]
    expected = hf[1].apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert engine.chat_prompt(messages) == expected


def test_export_refuses_an_existing_folder_and_leaves_it_alone(tiny_llama, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists.*--force"):
        export_model(str(tiny_llama[0]), out)
    assert (out / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_force_replaces_an_existing_export(tiny_llama, tmp_path):
    from edgeinfer.export import ExportOptions

    out = tmp_path / "again"
    shutil.copytree(tiny_llama[1], out)
    (out / "stale.txt").write_text("old")
    export_model(str(tiny_llama[0]), out, ExportOptions(force=True))
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]
    assert (
        Engine.load(out, provider="cpu").generate(PROMPT, max_new_tokens=8).token_ids
        == Engine.load(tiny_llama[1], provider="cpu").generate(PROMPT, max_new_tokens=8).token_ids
    )


def test_failed_export_leaves_nothing(tmp_path):
    (tmp_path / "notamodel").mkdir()
    (tmp_path / "notamodel" / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ExportError, match="'bert' cannot be exported"):
        export_model(str(tmp_path / "notamodel"), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notamodel"]


def test_export_above_tolerance_fails_with_the_figure_and_leaves_nothing(tiny_llama, tmp_path, monkeypatch):
    import edgeinfer.export.validate as validate

    monkeypatch.setattr(validate, "RELATIVE_TOLERANCE", {"float32": 0.0})
    with pytest.raises(ExportError, match=r"differ from PyTorch by \d.*e-0\d in the logits \(tolerance 0\)"):
        export_model(str(tiny_llama[0]), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_bad_prompts_are_refused_before_any_work(engine):
    from edgeinfer.sdk.errors import GenerationError

    with pytest.raises(GenerationError, match="the prompt is empty"):
        engine.generate("")
    with pytest.raises(GenerationError, match=r"token ids \[320, -1\] are outside the vocabulary \(0..319\)"):
        engine.generate([5, 320, -1])
    with pytest.raises(GenerationError, match="the prompt has 256 tokens but the model's context is 256"):
        engine.generate([5] * 256)
    with pytest.raises(GenerationError, match="max_new_tokens must be an integer of at least 1, got 0"):
        engine.generate("hi", max_new_tokens=0)


def test_generation_stops_at_the_context(engine):
    result = engine.generate([5] * 250, max_new_tokens=20)
    assert len(result.token_ids) == 6 and result.finish_reason == "length"


def test_a_tied_fp32_model_keeps_a_table_to_gather_rows_from(tmp_path):
    """fp32 keeps the [vocab, hidden] table beside the lm_head's weight: the table is read a row per
    token from the memory-mapped file, while a shared weight would stay resident once pre-packed
    (export/quantize.py, quantized_embedding). Generation equals transformers'."""
    from conftest import build_llama

    model = build_llama(tmp_path / "hf", tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    export_model(str(tmp_path / "hf"), tmp_path / "export")
    graph = onnx.load(str(tmp_path / "export" / "model.onnx")).graph
    (gather,) = [n for n in graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"]
    assert [list(t.dims) for t in graph.initializer if t.name == gather.input[0]] == [[320, 64]]
    ids = AutoTokenizer.from_pretrained(tmp_path / "hf")(PROMPT).input_ids
    engine = Engine.load(tmp_path / "export", provider="cpu")
    assert engine.generate(PROMPT, max_new_tokens=16).token_ids == hf_greedy(model, ids, 16)


def test_public_steps_return_logits_that_later_steps_do_not_overwrite(engine):
    """Only the generation loops keep one logits value bound from step to step; prefill and
    decode called on a batch of an app's return new logits every time."""
    batch = engine.runner.new_batch(1, 16)
    first = engine.runner.prefill(batch, [[5, 6, 7]]).numpy()
    kept = first.copy()
    second = engine.runner.decode(batch, [8]).numpy()
    engine.runner.decode(batch, [9])
    assert np.array_equal(first, kept) and not np.array_equal(first, second)


def test_fusion_falls_back_where_the_rewrite_does_not_apply_and_fails_on_a_bug(tiny_llama, tmp_path, monkeypatch):
    """'Does not apply' (PatternError) keeps the optimizer's graph and says why; any other error in
    the rewrite is a bug, and fails the export in one line instead of silently keeping a slower graph."""
    import edgeinfer.export.fuse as fuse
    from edgeinfer.export.attention import PatternError

    def not_this_pattern(*args, **kwargs):
        raise PatternError("layer 0 is not the pattern")

    monkeypatch.setattr(fuse, "rewrite_attention", not_this_pattern)
    manifest = export_model(str(tiny_llama[0]), tmp_path / "fallback")
    assert manifest.validation["fusion"]["attention"] == "attention kept as exported: layer 0 is not the pattern"
    assert not manifest.kv.in_place and "GroupQueryAttention" not in manifest.validation["fusion"]["fused"]

    def a_bug(*args, **kwargs):
        return {}["missing"]

    monkeypatch.setattr(fuse, "rewrite_attention", a_bug)
    with pytest.raises(
        ExportError, match="the fuse stage failed with KeyError: 'missing': this is a bug in edgeinfer.*--no-fuse"
    ) as error:
        export_model(str(tiny_llama[0]), tmp_path / "bug")
    assert isinstance(error.value.__cause__, KeyError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fallback"]
