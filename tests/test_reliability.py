"""Every bad export file, prompt and limit gets an edgeinfer error that names the problem and the
way out; the memory an engine needs is worked out before anything is allocated."""

import json
import shutil

import pytest

from edgeinfer import Engine
from edgeinfer.sdk.errors import GenerationError, ManifestError, NotAnExportError, SettingsError
from edgeinfer.sdk.manifest import load_manifest

# The tiny llama's cache: 2 layers x 2 kv heads x (16 + 16) values x 4 bytes per token and row.
KV_PER_TOKEN = 2 * 2 * 32 * 4


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine.load(tiny_llama[1], provider="cpu")


@pytest.fixture
def copy(tiny_llama, tmp_path):
    return shutil.copytree(tiny_llama[1], tmp_path / "export")


@pytest.mark.parametrize("name", ["model.onnx", "model.onnx.data", "tokenizer.json"])
def test_a_truncated_or_missing_export_file_is_named_before_onnx_runtime_reads_it(copy, name):
    path = copy / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        NotAnExportError, match=rf"{name} has {len(data) // 2} bytes but the manifest says {len(data)}.*export the model again"
    ):
        Engine.load(copy, provider="cpu")
    path.unlink()
    with pytest.raises(NotAnExportError, match=rf"{name} is missing.*export the model again"):
        Engine.load(copy, provider="cpu")


def test_a_truncated_manifest(copy):
    text = (copy / "edgeinfer.json").read_text()
    (copy / "edgeinfer.json").write_text(text[: len(text) // 2])
    with pytest.raises(ManifestError, match="edgeinfer.json is not valid JSON.*export the model again"):
        Engine.load(copy, provider="cpu")


def test_graph_inputs_that_do_not_match_the_manifest(copy):
    manifest = json.loads((copy / "edgeinfer.json").read_text())
    manifest["graph"]["inputs"] = manifest["graph"]["inputs"][:-1]
    (copy / "edgeinfer.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=r"model.onnx takes \[.*\] and gives .* but the manifest lists .*export the model again"):
        Engine.load(copy, provider="cpu")


def test_an_optimum_export_is_told_apart_from_an_edgeinfer_export(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.onnx").write_bytes(b"onnx")
    with pytest.raises(NotAnExportError, match="ONNX graphs but no edgeinfer.json.*run `edgeinfer export` on the Hugging Face model"):
        Engine.load(tmp_path, provider="cpu")


def test_verify_checks_every_hash(copy):
    manifest = load_manifest(copy)
    assert set(manifest.files) >= {"model.onnx", "model.onnx.data", "tokenizer.json"}
    Engine.load(copy, provider="cpu", verify=True)
    path = copy / "model.onnx.data"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the hash can tell
    path.write_bytes(bytes(data))
    Engine.load(copy, provider="cpu")  # sizes alone pass
    with pytest.raises(NotAnExportError, match="model.onnx.data does not match the SHA-256 in the manifest.*export the model again"):
        Engine.load(copy, provider="cpu", verify=True)


def test_a_prompt_longer_than_the_context_is_refused_or_keeps_its_end(engine):
    prompt = [5 + i % 200 for i in range(300)]
    with pytest.raises(GenerationError, match=r"the prompt has 300 tokens but the model's context is 256.*truncate='left'"):
        engine.generate(prompt)
    result = engine.generate(prompt, max_new_tokens=6, truncate="left")
    assert (result.prompt_tokens, result.truncated_tokens, len(result.token_ids)) == (250, 50, 6)
    assert result.token_ids == engine.generate(prompt[-250:], max_new_tokens=6).token_ids
    short = engine.generate(prompt[:20], max_new_tokens=6, truncate="left")
    assert (short.prompt_tokens, short.truncated_tokens) == (20, 0)


def test_truncation_makes_room_for_the_reply_and_keeps_one_token_at_least(engine):
    result = engine.generate([7] * 200, max_new_tokens=100, truncate="left")
    assert (result.prompt_tokens, result.truncated_tokens, len(result.token_ids)) == (156, 44, 100)
    result = engine.generate([7] * 10, max_new_tokens=1000, truncate="left")
    assert (result.prompt_tokens, len(result.token_ids), result.finish_reason) == (1, 255, "length")


def test_a_smaller_served_context_bounds_prompts_and_replies(tiny_llama):
    engine = Engine.load(tiny_llama[1], provider="cpu", max_context=32)
    assert engine.max_context == 32
    with pytest.raises(GenerationError, match=r"the prompt has 40 tokens but the engine's \(max_context\) context is 32"):
        engine.generate([5] * 40)
    result = engine.generate([5] * 20, max_new_tokens=50)
    assert (len(result.token_ids), result.finish_reason) == (12, "length")
    with pytest.raises(SettingsError, match="max_context 300 is more than the export's context of 256 tokens: pass at most 256"):
        Engine.load(tiny_llama[1], provider="cpu", max_context=300)


def test_the_memory_plan_counts_the_weights_and_the_cache_the_engine_allocates(engine):
    plan = engine.memory
    files = load_manifest(engine.folder).files
    assert plan.weights == files["model.onnx"]["size"] + files["model.onnx.data"]["size"]
    assert (plan.kv_per_token, plan.context, plan.batch) == (KV_PER_TOKEN, 256, 1)
    batch = engine.runner.new_batch(2, 40)
    engine.runner.prefill(batch, [[5, 6, 7], [8, 9]])
    allocated = sum(value.numpy().nbytes for value in batch.cache.buffers.values())
    assert allocated == plan.kv_per_token * 40 * 2


def test_loading_refuses_what_does_not_fit_and_says_what_would(engine, tiny_llama):
    weights = engine.memory.weights
    limit = weights + KV_PER_TOKEN * 100 + 10
    with pytest.raises(
        SettingsError,
        match=r"needs .* of weights and 128.0 KiB of KV cache \(256 tokens x 1 rows\), but the "
        r"memory limit has .*: load it with max_context=100, or free memory",
    ):
        Engine.load(tiny_llama[1], provider="cpu", memory_limit=limit)
    fitted = Engine.load(tiny_llama[1], provider="cpu", memory_limit=limit, max_context=100)
    assert len(fitted.generate([5] * 10, max_new_tokens=5).token_ids) == 5
    with pytest.raises(SettingsError, match="the weights alone do not fit; use a quantized export"):
        Engine.load(tiny_llama[1], provider="cpu", memory_limit=weights // 2)
    with pytest.raises(SettingsError, match=r"max_context=50, or max_batch=2,"):
        Engine.load(tiny_llama[1], provider="cpu", memory_limit=weights + KV_PER_TOKEN * 200, max_context=100, max_batch=4)


def test_a_batch_beyond_the_memory_limit_is_refused_before_its_cache_is_allocated(engine, tiny_llama):
    limit = engine.memory.weights + KV_PER_TOKEN * 256
    small = Engine.load(tiny_llama[1], provider="cpu", memory_limit=limit)
    prompts = [[5] * 60, [6] * 60, [7] * 60]
    with pytest.raises(
        GenerationError,
        match=r"3 rows of 100 tokens need 150.0 KiB of KV cache, but the memory limit has "
        r"128.0 KiB left: run at most 2 prompts at a time",
    ):
        small.generate_batch(prompts, max_new_tokens=40)
    rows = small.generate_batch(prompts[:2], max_new_tokens=40)
    assert [len(r.token_ids) for r in rows] == [40, 40]


def test_bad_limits_are_refused():
    from edgeinfer.sdk.memory import LoadLimits

    for field, value in (("max_context", 1), ("max_batch", 0), ("memory_limit", -5), ("max_batch", True)):
        with pytest.raises(SettingsError, match=f"{field} must be an integer of at least"):
            LoadLimits(**{field: value})
