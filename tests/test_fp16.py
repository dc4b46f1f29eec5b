"""`--dtype fp16`: weights, activations, KV cache and logits in float16, checked against transformers."""

import onnx
import pytest
from onnx import TensorProto
from conftest import closeness, logits_against_transformers
from test_quantization import LOGITS_BOUNDS
from test_tiny_llama import PROMPT, hf_greedy
from transformers import AutoModelForCausalLM, AutoTokenizer

from edgeinfer import Engine
from edgeinfer.export import ExportOptions, Quantization, export_model
from edgeinfer.sdk.errors import ExportError


@pytest.fixture(scope="module")
def half(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16") / "export"
    manifest = export_model(str(tiny_llama[0]), out, ExportOptions(dtype="fp16"))
    return manifest, out


def test_the_graph_and_its_cache_are_float16(half, tiny_llama):
    manifest, folder = half
    assert (manifest.dtype, manifest.kv.dtype, manifest.kv.in_place) == ("float16", "float16", True)
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    types = {i.name: i.type.tensor_type.elem_type for i in [*graph.input, *graph.output]}
    assert all(types[name] == TensorProto.FLOAT16 for name in [*manifest.kv.past, *manifest.kv.present, "logits"])
    weights = [t for t in graph.initializer if len(t.dims) == 2 and min(t.dims) >= 64]
    assert weights and all(t.data_type == TensorProto.FLOAT16 for t in weights)
    fp32 = (tiny_llama[1] / "model.onnx.data").stat().st_size
    assert 0.45 < (folder / "model.onnx.data").stat().st_size / fp32 < 0.55
    check = manifest.validation["float16"]
    assert max(check["max_abs_diff_prefill"], check["max_abs_diff_decode"]) <= check["tolerance"]


def test_float16_generates_transformers_greedy_tokens(half, tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama[0]).eval()
    ids = AutoTokenizer.from_pretrained(tiny_llama[0])(PROMPT).input_ids
    engine = Engine.load(half[1], provider="cpu")
    assert engine.generate(PROMPT, max_new_tokens=16).token_ids == hf_greedy(model, ids, 16)
    rows = engine.generate_batch([PROMPT, "Edge boxes"], max_new_tokens=8)
    assert [r.token_ids for r in rows] == [engine.generate(p, max_new_tokens=8).token_ids for p in (PROMPT, "Edge boxes")]
    sampled = engine.generate(PROMPT, max_new_tokens=8, temperature=0.8, seed=5)
    assert sampled.token_ids == engine.generate(PROMPT, max_new_tokens=8, temperature=0.8, seed=5).token_ids


def test_float16_with_int4_weights(tiny_llama, tmp_path):
    """fp16 activations and cache with int4 weights (the GPU combination): MatMulNBits takes float16
    scales, the quality against PyTorch fp32 is measured, and generation runs."""
    manifest = export_model(str(tiny_llama[0]), tmp_path / "export", ExportOptions(dtype="fp16", quantization=Quantization("int4")))
    assert (manifest.dtype, manifest.kv.dtype, manifest.quantization["method"]) == ("float16", "float16", "int4")
    graph = onnx.load(str(tmp_path / "export" / "model.onnx")).graph
    initializers = {t.name: t for t in graph.initializer}
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 * 4 + 1 and all(initializers[n.input[2]].data_type == TensorProto.FLOAT16 for n in nbits)
    assert 0.3 < manifest.quantization["top1_agreement"] <= 1.0  # the tiny llama's random weights: see test_quantization
    model = AutoModelForCausalLM.from_pretrained(tiny_llama[0]).eval()
    ids = AutoTokenizer.from_pretrained(tiny_llama[0])(PROMPT).input_ids
    cosine, difference = closeness(*logits_against_transformers(Engine.load(tmp_path / "export", provider="cpu"), model, ids))
    assert cosine >= LOGITS_BOUNDS["int4"][0] and difference <= LOGITS_BOUNDS["int4"][1], (cosine, difference)  # measured 0.81, 0.51


def test_bad_dtype_settings():
    with pytest.raises(ExportError, match="unknown dtype 'bf16': use 'fp32' or 'fp16'"):
        ExportOptions(dtype="bf16")
