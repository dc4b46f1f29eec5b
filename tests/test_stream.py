"""Streamed export (export/stream.py): a large model exported streamed (loaded in its checkpoint's
precision, checked on a copy of its first layers, its weights deferred until quantized or
written) gives transformers' tokens. That the graph traced with its matrices hollow is torch.onnx's
own over the real weights, every family: tests/test_architectures.py."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from architectures import tiny_config
from conftest import build_llama
from edgeinfer.export import ExportOptions, Quantization, export_model
from edgeinfer.export import budget, stages
from edgeinfer.export.graphs import GRAPH_FILE, export_graph
from edgeinfer.export.source import Source, check_layers, source_sizes, truncated
from edgeinfer.export.stream import streamed
from edgeinfer.sdk import Engine
from edgeinfer.sdk.errors import ExportError

PROMPT = [1, 5, 9, 33, 70, 12]


def test_a_trace_that_folds_a_matrix_into_a_constant_is_traced_again_with_the_real_weights(tmp_path, monkeypatch):
    """A forward that computes with a matrix (here the lm_head's weight times 2) makes torch.onnx fold
    the product into a constant, which a hollow matrix gives as NaN: a model loaded in fp32 is traced
    again with its matrices as they are, and its graph computes transformers' logits; one in bf16
    (a streamed export) is refused."""
    from edgeinfer.export.graphs import export_graph
    from edgeinfer.export.stream import FoldedWeight

    import onnxruntime as ort

    model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    head = model.lm_head
    monkeypatch.setattr(head, "forward", lambda x: torch.nn.functional.linear(x, head.weight * 2))
    export_graph(model, tmp_path)
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {
        i.name: np.zeros([1 if d == "batch_size" else 0 if isinstance(d, str) else d for d in i.shape], np.float32)
        for i in session.get_inputs()
        if i.name.startswith("past")
    }
    ids = [[5, 9, 17, 33]]
    feeds.update(input_ids=np.array(ids), attention_mask=np.ones((1, 4), np.int64), position_ids=np.arange(4)[None])
    feeds["logits_to_keep"] = np.array(1, np.int64)
    names = {i.name for i in session.get_inputs()}
    logits = session.run(["logits"], {k: v for k, v in feeds.items() if k in names})[0]
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits[0, -1].numpy()
    assert np.abs(logits[0, -1] - expected).max() < 1e-4 and np.abs(expected).max() > 0
    (tmp_path / "bf16").mkdir()
    with pytest.raises(FoldedWeight, match="through more than a transpose"):
        export_graph(model.to(torch.bfloat16), tmp_path / "bf16")


def test_a_fold_that_computes_from_a_hollow_weight_is_refused_with_the_way_out():
    hollow_view = torch.full((6,), float("nan")).as_strided((2, 3), (1, 2))
    computed = hollow_view * 2  # a new tensor: not a view of the hollow storage, and NaN
    with pytest.raises(ExportError, match=r"folded a large weight into w2 \(\(2, 3\)\).*--no-stream"):
        streamed({"w2": computed}, {hollow_view.untyped_storage().data_ptr(): ("w", torch.ones(2, 3), (1, 2))})
    sliced = hollow_view[:, 1:]
    with pytest.raises(ExportError, match=r"folded the weight w into a view of shape \(2, 2\) that is not a permutation"):
        streamed({"w2": sliced}, {hollow_view.untyped_storage().data_ptr(): ("w", torch.ones(2, 3), (1, 2))})
    loaded = torch.arange(6.0, dtype=torch.bfloat16).reshape(2, 3)
    made = streamed({"w2": hollow_view.t()}, {hollow_view.untyped_storage().data_ptr(): ("w", loaded, (1, 2))})["w2"]()
    assert made.dtype == torch.float32 and torch.equal(made, loaded.float().t())


def test_a_check_copy_takes_the_first_layer_of_each_kind():
    llama = tiny_config("llama")
    llama.num_hidden_layers = 16
    assert check_layers(llama) == 2
    hybrid = tiny_config("qwen3_5_text")
    hybrid.layer_types, hybrid.num_hidden_layers = hybrid.layer_types * 2, 2 * hybrid.num_hidden_layers
    assert hybrid.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert check_layers(hybrid) == 4
    copy = truncated(hybrid, 4)
    assert copy.num_hidden_layers == 4 and copy.layer_types == hybrid.layer_types[:4]
    assert hybrid.num_hidden_layers == len(hybrid.layer_types) == 8  # the model's own config is left alone


@pytest.fixture(scope="module")
def deep_bf16_llama(tmp_path_factory):
    """A 5-layer llama saved in bfloat16 (as most checkpoints are), and its fp32 model."""
    folder = tmp_path_factory.mktemp("deep") / "hf"
    build_llama(folder, num_hidden_layers=5).to(torch.bfloat16).save_pretrained(folder)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _greedy(model, ids, n=12):
    with torch.no_grad():
        return model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids) :].tolist()


def test_a_streamed_export_checks_a_copy_and_gives_the_models_tokens(deep_bf16_llama, tmp_path):
    folder, model = deep_bf16_llama
    said = []
    manifest = export_model(str(folder), tmp_path / "out", ExportOptions(stream=True), say=said.append)
    assert (
        said[0] == "[1/6] check" and "[2/6] load" in said and any(line.startswith("      check copy: [4/6] validate") for line in said)
    )
    validation = manifest.validation
    assert validation["checked_on"] == "a copy of the first 2 of the model's 5 layers" and validation["passed"]
    assert validation["max_abs_diff_prefill"] <= validation["tolerance"]
    assert validation["fusion"]["fused"]["GroupQueryAttention"] == 5  # the whole model fused as its copy was
    assert manifest.kv.num_layers == 5 and manifest.kv.in_place
    assert Engine.load(tmp_path / "out").generate(PROMPT, max_new_tokens=12).token_ids == _greedy(model, PROMPT)
    assert not (tmp_path / "out" / ".check").exists() and not list((tmp_path / "out").glob("*.packed.data"))


def test_a_streamed_int4_export_keeps_at_8_bits_what_its_copy_chose(deep_bf16_llama, tmp_path):
    folder, _ = deep_bf16_llama
    manifest = export_model(
        str(folder), tmp_path / "out", ExportOptions(stream=True, quantization=Quantization("int4", algorithm="rtn"))
    )
    quantization = manifest.quantization
    assert quantization["quality"] == "not measured (a streamed export)" and quantization["algorithm"] == "rtn"
    assert quantization["keep_int8"] and "auto" not in quantization["keep_int8"]
    import onnx

    graph = onnx.load(str(tmp_path / "out" / GRAPH_FILE), load_external_data=False).graph
    bits = {node.name: next(a.i for a in node.attribute if a.name == "bits") for node in graph.node if node.op_type == "MatMulNBits"}
    kept = [name for name, b in bits.items() if b == 8]
    assert len(bits) == 5 * 4 + 1 and kept  # qkv, o, gate_up and down in each layer, and the lm_head
    assert all(any(module in name for module in quantization["keep_int8"]) for name in kept)
    result = Engine.load(tmp_path / "out").generate(PROMPT, max_new_tokens=8)
    assert len(result.token_ids) == 8


def test_stream_is_refused_where_it_cannot_apply_and_left_out_for_small_models(deep_bf16_llama, tmp_path):
    folder, _ = deep_bf16_llama
    with pytest.raises(
        ExportError, match=r"--stream cannot export this model: --dtype fp16 converts the whole graph in memory; leave --stream out"
    ):
        export_model(str(folder), tmp_path / "a", ExportOptions(stream=True, dtype="fp16"))
    said = []
    export_model(str(folder), tmp_path / "b", say=said.append)  # 0.4 MiB of weights: exported whole, checked whole
    assert said[0] == "[1/6] load" and not any("check copy" in line for line in said)
    sizes = source_sizes(Source("deep", str(folder)))
    assert sizes.stored == 2 * sizes.parameters and sizes.largest == 320 * 64  # bfloat16; the embedding table
    assert sizes.widest == deep_bf16_llama[1].config.intermediate_size  # down_proj's input


def test_a_streamed_export_too_big_for_the_machine_is_refused_before_loading(deep_bf16_llama, tmp_path, monkeypatch):
    folder, _ = deep_bf16_llama
    monkeypatch.setattr(budget, "available_memory", lambda: 100 * 2**10)
    monkeypatch.setattr(stages, "load_model", lambda *a, **k: pytest.fail("loaded"))
    for algorithm in ("gptq", "rtn"):  # neither holds the fp32 graph: gptq's calibration runs in PyTorch
        with pytest.raises(
            ExportError, match=r"needs about 1.00 GiB of memory \(its largest tensor twice in fp32 and GPTQ's working memory"
        ):
            quantization = Quantization("int4", algorithm=algorithm)
            export_model(str(folder), tmp_path / "out", ExportOptions(stream=True, quantization=quantization))
    assert not re.search("partial", " ".join(p.name for p in tmp_path.iterdir()))


def test_pages_let_go_of_a_mapped_checkpoint_read_back_the_same_and_written_ones_stay(deep_bf16_llama):
    """A weight loaded in its checkpoint's precision is a view of the mapped file: its pages are let
    go once it is made (export/stream.py `release_file_pages`), and read again from the file if
    touched. A page written to is no longer the file's: then nothing is let go."""
    from edgeinfer.export.stream import _PAGE, _file_pages, _in_mapped_checkpoint, release_file_pages

    folder, _ = deep_bf16_llama
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    table = model.model.embed_tokens.weight.data
    start = table.untyped_storage().data_ptr() + table.storage_offset() * table.element_size()
    first, last = -(-start // _PAGE) * _PAGE, (start + table.numel() * table.element_size()) // _PAGE * _PAGE
    assert table.dtype == torch.bfloat16 and last - first >= 4 * _PAGE
    assert _in_mapped_checkpoint(first, last) and _file_pages(first, last)
    before = table.clone()
    release_file_pages(table)
    assert torch.equal(table, before)
    table[table.shape[0] // 2, 0] += 1  # the page is copied on write: the file's no longer
    written = table.clone()
    assert not _file_pages(first, last)
    release_file_pages(table)
    assert torch.equal(table, written) and not torch.equal(table, before)
    assert not _in_mapped_checkpoint(*(lambda a: (a, a + _PAGE))(-(-torch.zeros(4096).data_ptr() // _PAGE) * _PAGE))


def test_the_command_line_streams_with_stream_and_refuses_what_cannot_be(deep_bf16_llama, tmp_path):
    import json

    from test_cli import edgeinfer

    folder, _ = deep_bf16_llama
    done = edgeinfer("export", str(folder), "-o", str(tmp_path / "out"), "--stream")
    assert done.returncode == 0 and "check copy: [4/6] validate" in done.stderr, done.stderr
    manifest = json.loads((tmp_path / "out" / "edgeinfer.json").read_text())
    assert manifest["validation"]["checked_on"] == "a copy of the first 2 of the model's 5 layers"
    done = edgeinfer("export", str(folder), "-o", str(tmp_path / "split"), "--stream", "--graphs", "split")
    assert done.returncode != 0 and "--stream cannot export this model: --graphs split converts the whole graph" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "split").exists()
    done = edgeinfer("export", str(folder), "-o", str(tmp_path / "whole"), "--no-stream")
    assert done.returncode == 0 and "check copy" not in done.stderr
    # the check copy's quantizer sets the root logger to INFO at its import: the model's fuse stage
    # after it logs nothing of ONNX Runtime's optimizer (fusion_utils, onnx_model) all the same
    done = edgeinfer("export", str(folder), "-o", str(tmp_path / "int4"), "--stream", "--quantize", "int4", "--algorithm", "rtn")
    assert done.returncode == 0 and "[6/7] quantize" in done.stderr and "[INFO]" not in done.stderr, done.stderr


@pytest.mark.parametrize("algorithm", ["rtn", "hqq"])
def test_deferred_weights_quantize_to_the_bytes_of_the_whole_fp32_export(deep_bf16_llama, tmp_path, algorithm, monkeypatch):
    """Streamed, each weight is made from the bf16 checkpoint as it is quantized (packed ones
    too; the untied embedding table a band of rows at a time); unstreamed, the same weights are
    read from the fp32 graph's data file: the same tensors, byte for byte, and the same nodes."""
    import onnx

    import edgeinfer.export.table as table
    from edgeinfer.export.graphs import tensor_array

    folder, _ = deep_bf16_llama
    monkeypatch.setattr(table, "_ROWS_BYTES", 64 * 4 * 100)  # the 320 rows of 64 in 4 bands
    quantization = Quantization("int4", algorithm=algorithm, keep_int8=("down_proj",))
    graphs = {}
    for stream in (True, False):
        out = tmp_path / str(stream)
        export_model(str(folder), out, ExportOptions(stream=stream, quantization=quantization, quality=False))
        model = onnx.load(str(out / GRAPH_FILE), load_external_data=False)
        tensors = {t.name: np.asarray(tensor_array(t, out)).tobytes() for t in model.graph.initializer}
        graphs[stream] = tensors, sorted(n.SerializeToString() for n in model.graph.node)
    assert graphs[True][0].keys() == graphs[False][0].keys()
    assert [n for n in graphs[True][0] if graphs[True][0][n] != graphs[False][0][n]] == []
    assert graphs[True][1] == graphs[False][1]
    assert sum(name.endswith("_Q8") for name in graphs[True][0]) == 5 + 1  # down_proj in each layer and the table, at 8 bits
    assert sum(b"GatherBlockQuantized" in node for node in graphs[True][1]) == 1  # no fp32 table left


def test_equal_weights_are_written_once_and_read_under_one_name(tmp_path):
    """torch.onnx merges equal initializers, which a trace of hollow weights cannot see: export
    merges them as it writes them (a new gpt_oss's expert biases all start at zero), and the
    graph computes what the model does."""
    import onnx
    import onnxruntime as ort

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.copy_(model.model.layers[0].mlp.up_proj.weight)
    export_graph(model, tmp_path)
    graph = onnx.load(str(tmp_path / GRAPH_FILE), load_external_data=False).graph
    ups = [n for n in graph.node if n.op_type == "MatMul" and "up_proj" in n.name]
    assert len(ups) == 2 and ups[0].input[1] == ups[1].input[1]  # one initializer, read by both layers
    assert sum(t.name == ups[0].input[1] for t in graph.initializer) == 1
    ids = np.array([[5, 9, 33, 70]])
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(4)[None], "logits_to_keep": np.array(4)}
    session = ort.InferenceSession(str(tmp_path / GRAPH_FILE), providers=["CPUExecutionProvider"])
    for value in session.get_inputs():
        if value.name.startswith("past_key_values"):
            feeds[value.name] = np.zeros([1, value.shape[1], 0, value.shape[3]], np.float32)
    logits = session.run(["logits"], feeds)[0]
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-4)


def test_pytorchs_calibration_hessians_are_those_the_fp32_graph_gives(tmp_path):
    """The sums a streamed export keeps from PyTorch (`collect_from_model`, by parameter name, q, k
    and v once) are those the whole export's graph gives its MatMuls over the same tokens
    (`collect`, by MatMul input), window by window: each of the one's Hessians is one of the
    other's, to fp32 rounding, and its importance is its diagonal."""
    from edgeinfer.export.calibration import collect, collect_from_model

    folder = tmp_path / "hf"
    model = build_llama(folder, num_hidden_layers=2)
    export_model(str(folder), tmp_path / "fp32", ExportOptions(fuse=False))
    ids = [int(i) for i in np.random.default_rng(3).integers(3, 200, 600)]  # two full windows (one run) and a short one
    graph = collect(tmp_path / "fp32", ids, tmp_path / "graph", hessian=True)
    torch_side = collect_from_model(model, ids, tmp_path / "torch", hessian=True)
    assert len(torch_side.names) == 2 * 4 + 1  # q (k, v read it), o, gate (up reads it), down; the lm_head
    assert torch_side.aliases["model.layers.1.self_attn.v_proj.weight"] == "model.layers.1.self_attn.q_proj.weight"
    assert torch_side.counts["lm_head.weight"] == 3 and torch_side.counts["model.layers.0.mlp.down_proj.weight"] == 600
    assert set(graph.counts.values()) == {600, 3}
    found = [graph.hessian(name) for name in graph.names]
    for name in torch_side.names:
        hessian = torch_side.hessian(name)
        assert np.array_equal(np.diagonal(hessian), torch_side.importance(name))
        assert any(h.shape == hessian.shape and np.allclose(h, hessian, rtol=1e-4, atol=1e-5) for h in found), name
    q, k = (f"model.layers.1.self_attn.{m}_proj.weight" for m in "qk")
    assert np.array_equal(torch_side.hessian(k), torch_side.hessian(q)) and torch_side.hessian("nowhere") is None


@pytest.mark.parametrize("width", [6, 7])
def test_a_hessian_is_kept_as_one_triangle_and_summed_exactly(tmp_path, width):
    """`Activations` keeps X^T X of the rows added, pass after pass, in K (K + 1) / 2 floats (an
    odd K with a zero channel added), read back as the full symmetric matrix; without `hessian`,
    the channels' mean squares alone."""
    from edgeinfer.export.calibration import Activations

    rows = np.random.default_rng(0).standard_normal((40, width)).astype(np.float32)
    kept, squares = Activations(tmp_path / "h", hessian=True), Activations(tmp_path / "s", hessian=False)
    for store in (kept, squares):
        (tmp_path / store.folder.name).mkdir()
        store.add("x", rows[:25])
        store.add("x", torch.from_numpy(rows[25:]).to(torch.bfloat16))
    seen = np.concatenate([rows[:25], torch.from_numpy(rows[25:]).to(torch.bfloat16).float().numpy()])
    assert np.load(next((tmp_path / "h").glob("*.npy"))).size == (width + width % 2) * (width + width % 2 + 1) // 2
    np.testing.assert_allclose(kept.hessian("x"), seen.T @ seen / 40, rtol=1e-5, atol=1e-6)
    assert np.array_equal(kept.hessian("x"), kept.hessian("x").T)
    np.testing.assert_allclose(squares.importance("x"), np.mean(seen * seen, 0), rtol=1e-5)
    assert squares.hessian("x") is None and kept.counts == squares.counts == {"x": 40}


@pytest.mark.slow  # three exports of the 5-layer model
def test_a_streamed_gptq_export_rounds_as_the_whole_one_without_an_fp32_graph(deep_bf16_llama, tmp_path):
    """The default int4 (gptq) streamed: its calibration taken from the bf16 model in PyTorch, no
    fp32 graph written; each MatMul's 4-bit levels mostly those of the whole export (fp32 graph,
    fp32 activations), far more so than round to nearest's, which no Hessian would leave."""
    import onnx

    from edgeinfer.export.graphs import tensor_array

    folder, _ = deep_bf16_llama
    levels, said = {}, []
    for name, stream, algorithm in (("stream", True, "gptq"), ("whole", False, "gptq"), ("rtn", False, "rtn")):
        quantization = Quantization("int4", algorithm=algorithm, keep_int8=("down_proj",))
        out = tmp_path / name
        export_model(str(folder), out, ExportOptions(stream=stream, quantization=quantization, quality=False), say=said.append)
        graph = onnx.load(str(out / GRAPH_FILE), load_external_data=False).graph
        weights = {
            n.input[1] for n in graph.node if n.op_type == "MatMulNBits"
        }  # (the embedding table: rounded to nearest in all three)
        levels[name] = {
            t.name: np.asarray(tensor_array(t, out)) for t in graph.initializer if t.name.endswith("_Q4") and t.name in weights
        }
    assert "[5/8] calibrate" in said and not any("[5/8] calibrate" in line for line in said[said.index("[8/8] write") :])
    assert len(levels["stream"]) == 5 * 3 + 1 and levels["stream"].keys() == levels["whole"].keys()
    for weight, whole in levels["whole"].items():
        assert np.mean(levels["stream"][weight] == whole) > 0.9 > 0.8 > np.mean(levels["rtn"][weight] == whole), weight
