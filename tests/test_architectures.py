"""Every decoder family edgeinfer supports: a tiny random-weight model of each, built from its
transformers config in the test, exported, and checked against transformers with `check_export`
(the check `edgeinfer check` runs): 16 greedy tokens, prefill and decode logits, and a batch of
two prompts of different lengths against each prompt alone."""
import json

import pytest
import torch
from architectures import TINY, WINDOW, model_type, tiny_config
from conftest import build_tokenizer
from transformers import AutoModelForCausalLM

from edgeinfer.export import export_model
from edgeinfer.export.check import check_export
from edgeinfer.export.families import SUPPORTED, UNSUPPORTED
from edgeinfer.sdk.errors import ExportError

PROMPT = list(range(3, 43))  # 40 tokens: longer than every sliding window in TINY
NEW_TOKENS = 16
# Shapes that break naive code, and where each family shows one.
LAYOUT = {
    "falcon": {"num_kv_heads": 1},  # multi-query attention
    "gpt_bigcode": {"num_kv_heads": 1},
    "llama": {"num_kv_heads": 2},  # grouped-query attention
    "phi@gqa": {"num_kv_heads": 2},
    "deepseek_v3": {"head_size": 12, "value_head_size": 6},  # keys and values of different head sizes
}
# Graphs without a position_ids input: ALiBi families, and rotary families whose graph counts
# positions from the cache length (a left-padded row's positions are then shifted by its padding,
# which rotary attention does not see: it depends only on the distance between positions).
# The optimizer's RotaryEmbedding takes position ids per row; graphs that count positions from the
# cache length give it one row, so a batch fails and export keeps the unfused graph.
FUSION_SKIPPED = {"nemotron"}
# Families whose attention export rewrites to GroupQueryAttention with the cache written in place
# (export/attention.py). The others keep optimum-onnx's attention, and the manifest says why: ALiBi
# (bloom, falcon@alibi, mpt), windows the pattern does not take (gpt_neo, gpt_oss), keys and values of
# different head sizes (deepseek_v3), and gemma3_text, whose rewritten graph fails the logits check.
IN_PLACE = {"arcee", "codegen", "cohere", "falcon", "falcon@gqa", "gpt2", "stablelm", "phi@gqa", "gemma", "gemma2", "glm", "gpt_bigcode", "gpt_neox", "gptj", "granite", "helium",
            "llama", "mistral", "olmo", "olmo2", "opt", "phi", "phi3", "qwen2", "qwen3", "qwen3_moe", "smollm3"}
ROTARY_IN_ATTENTION = {"arcee", "gemma", "gemma2", "granite", "llama", "mistral", "olmo", "qwen2", "smollm3"}
WITHOUT_POSITION_IDS = {"bloom", "mpt", "falcon@alibi", "gemma", "gemma2", "gemma3_text", "gpt_oss", "nemotron"}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_every_supported_family_has_a_tiny_model():
    assert sorted({model_type(name) for name in TINY} - set(UNSUPPORTED)) == sorted(SUPPORTED)
    assert max(len(PROMPT), NEW_TOKENS) > WINDOW


@pytest.mark.parametrize("name", [name for name in TINY if model_type(name) in SUPPORTED])
def test_family_matches_transformers(name, tokenizer, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(name)).eval()
    model.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")
    manifest = export_model(str(tmp_path / "hf"), tmp_path / "export")
    assert manifest.architecture == model_type(name)
    for field, value in LAYOUT.get(name, {}).items():
        assert getattr(manifest.kv, field) == value, field
    fusion = manifest.validation["fusion"]  # fused where ONNX Runtime's optimizer checks out, else kept unfused
    assert ("skipped" in fusion) == (name in FUSION_SKIPPED), fusion
    assert manifest.kv.in_place == (name in IN_PLACE), fusion
    if manifest.kv.in_place:  # where rotation moved into the attention, the graph needs no position ids
        assert fusion["fused"]["GroupQueryAttention"] == 2
        assert ("position_ids" in manifest.graph.inputs) == (name not in ROTARY_IN_ATTENTION)
    else:
        assert ("position_ids" in manifest.graph.inputs) == (name not in WITHOUT_POSITION_IDS)

    result = check_export(tmp_path / "export", model, PROMPT, NEW_TOKENS)
    assert result.tokens == result.expected_tokens and len(result.tokens) == NEW_TOKENS
    assert result.max_abs_diff_prefill <= result.tolerance and result.max_abs_diff_decode <= result.tolerance
    assert result.batch_rows_equal_single


@pytest.mark.xfail(strict=True, raises=ValueError, reason=UNSUPPORTED["internlm2"])
def test_internlm2_is_unknown_to_transformers():
    """The limit itself: transformers 4.57 raises 'Unrecognized model identifier: internlm2'."""
    tiny_config("internlm2")


def test_unsupported_and_unknown_model_types_are_refused_in_one_line(tmp_path):
    for model_type_, reason in [("internlm2", "transformers 4.57 has no internlm2 model; its checkpoints need trust_remote_code"),
                                ("bart", "edgeinfer exports decoder-only language models"),
                                ("made_up_lm", "edgeinfer exports decoder-only language models")]:
        folder = tmp_path / model_type_
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": model_type_}))
        with pytest.raises(ExportError, match=f"model type '{model_type_}' cannot be exported: {reason}.*edgeinfer info --architectures"):
            export_model(str(folder), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_context_comes_from_the_config_else_the_tokenizer_else_the_flag():
    from types import SimpleNamespace

    from edgeinfer.export.pipeline import max_context

    unlimited = SimpleNamespace(model_max_length=int(1e30))
    assert max_context(SimpleNamespace(model_type="mpt", max_seq_len=2048), unlimited, None) == 2048
    assert max_context(SimpleNamespace(model_type="bloom"), SimpleNamespace(model_max_length=4096), None) == 4096
    assert max_context(SimpleNamespace(model_type="bloom"), unlimited, 1024) == 1024
    with pytest.raises(ExportError, match="the bloom config names no maximum context length: pass --max-context N"):
        max_context(SimpleNamespace(model_type="bloom"), unlimited, None)
