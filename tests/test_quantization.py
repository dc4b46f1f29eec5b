"""Quantized exports of the tiny llama: MatMulNBits weights, the quality cost measured and stored,
generation that still works, and clear errors for bad settings."""

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from edgeinfer import Engine
from edgeinfer.export import ExportOptions, Quantization, export_model
from edgeinfer.sdk.errors import ExportError


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized(request, tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "export"
    export_model(str(tiny_llama[0]), out, ExportOptions(quantization=Quantization(request.param)))
    return request.param, out


def test_quantized_export_has_nbits_weights_and_its_measured_quality(quantized, tiny_llama):
    method, folder = quantized
    manifest = json.loads((folder / "edgeinfer.json").read_text())
    quality = manifest["quantization"]
    assert (quality["method"], quality["block_size"], quality["accuracy_level"]) == (method, 32, 4)
    assert quality["text_tokens"] == 256  # the fixed text, cut to the tiny model's context
    # llama-perplexity's way: one window of the tiny context, its second half (127 predictions) scored
    assert quality["window"] == 256 and quality["perplexity_windowed"] > 1 and quality["perplexity_windowed_fp32"] > 1
    assert quality["perplexity_windowed"] != quality["perplexity"]
    # The tiny llama's random weights are hard on int4: 43% agreement, the same with the unfused graph.
    assert (
        {"int4": 0.3, "int8": 0.85}[method] < quality["top1_agreement"] <= 1.0
        and quality["perplexity"] > 1
        and quality["perplexity_fp32"] > 1
    )
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 2 * 4 + 1  # packed qkv, o, packed gate and up, down per layer, and the lm_head
    kept = set(quality["keep_int8"])  # int4's default: the modules --keep-int8 auto chose
    assert "auto" not in kept and (method == "int4" or not kept)
    for node in nbits:
        bits = next(a.i for a in node.attribute if a.name == "bits")
        assert bits == (8 if _role_of_node(node.name) in kept else int(method[3:])), node.name
    fp32 = (tiny_llama[1] / "model.onnx.data").stat().st_size
    assert (folder / "model.onnx.data").stat().st_size < fp32 * (0.4 if method == "int4" else 0.6)  # embeddings stay fp32


def test_no_quality_skips_the_measure_and_says_so(tiny_llama, tmp_path):
    """--no-quality: the same quantized weights, no quality in the manifest, and the export says so;
    measured, the line says how long the measure took."""
    said, skipped = [], []
    export_model(
        str(tiny_llama[0]), tmp_path / "skipped", ExportOptions(quantization=Quantization("int8"), quality=False), say=skipped.append
    )
    export_model(str(tiny_llama[0]), tmp_path / "measured", ExportOptions(quantization=Quantization("int8")), say=said.append)
    manifests = {
        name: json.loads((tmp_path / name / "edgeinfer.json").read_text())["quantization"] for name in ("skipped", "measured")
    }
    assert manifests["skipped"]["quality"] == "not measured (--no-quality)" and "top1_agreement" not in manifests["skipped"]
    assert manifests["measured"]["top1_agreement"] > 0.85 and "quality" not in manifests["measured"]
    assert "quality not measured (--no-quality)" in skipped and not any("top-1 agreement" in line for line in skipped)
    assert any(line.startswith("int8: top-1 agreement") and "s (--no-quality skips it)" in line for line in said)
    data = [(tmp_path / name / "model.onnx.data").read_bytes() for name in ("skipped", "measured")]
    assert data[0] == data[1]


def test_int8_is_closer_to_fp32_than_int4(tiny_llama, tmp_path):
    results = {}
    for method in ("int4", "int8"):
        export_model(str(tiny_llama[0]), tmp_path / method, ExportOptions(quantization=Quantization(method)))
        results[method] = json.loads((tmp_path / method / "edgeinfer.json").read_text())["quantization"]
    assert results["int8"]["top1_agreement"] > results["int4"]["top1_agreement"]
    assert abs(results["int8"]["perplexity"] - results["int8"]["perplexity_fp32"]) < abs(
        results["int4"]["perplexity"] - results["int4"]["perplexity_fp32"]
    )


# The worst step's cosine with transformers' fp32 logits, and the largest difference relative to the
# largest logit, over 16 steps. Measured on the tiny llama: int8 0.998 and 0.07, int4 0.82 and 0.52
# (its random weights are hard on int4); unrelated logits have a cosine near 0.
LOGITS_BOUNDS = {"int8": (0.99, 0.15), "int4": (0.7, 0.8)}


def test_a_quantized_export_follows_transformers_logits_within_its_error(quantized, tiny_llama):
    from conftest import closeness, logits_against_transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    method, folder = quantized
    model = AutoModelForCausalLM.from_pretrained(tiny_llama[0]).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama[0])
    engine = Engine.load(folder, provider="cpu")
    cosine, difference = closeness(*logits_against_transformers(engine, model, tokenizer("The capital of France is").input_ids))
    least_cosine, most_difference = LOGITS_BOUNDS[method]
    assert cosine >= least_cosine and difference <= most_difference, (cosine, difference)
    pieces = list(engine.stream("The capital of France is", max_new_tokens=12))
    tokens = [t for p in pieces for t in p.token_ids]
    assert len(tokens) == 12 and "".join(p.text for p in pieces) == tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"method": "int3"}, "unknown quantization 'int3': use 'int4' or 'int8'"),
        ({"method": "int4", "block_size": 48}, "block size must be a power of two of at least 16, got 48"),
        ({"method": "int4", "algorithm": "awq"}, "unknown quantization algorithm 'awq': use one of rtn, k_quant, gptq, hqq"),
        ({"method": "int4", "keep_int8": ("down_proj:0-",)}, "--keep-int8 takes module names with optional layers"),
        ({"method": "int4", "algorithm": "k_quant", "symmetric": True}, "k_quant fits a zero point to every block"),
        (
            {"method": "int4", "algorithm": "rtn", "keep_int8": (), "calibration": "text.txt"},
            "--calibration is for --algorithm k_quant or gptq, or --keep-int8 auto",
        ),
        ({"method": "int4", "algorithm": "hqq", "symmetric": True}, "hqq fits a zero point to every block"),
        ({"method": "int4", "keep_int8": ("auto", "lm_head")}, "--keep-int8 auto chooses the modules itself: give auto alone"),
        ({"method": "int4", "embedding_bits": 2}, "an untied embedding table is kept in 4- or 8-bit blocks, not 2: use 4 or 8"),
    ],
)
def test_bad_quantization_settings(settings, message):
    with pytest.raises(ExportError, match=message):
        Quantization(**settings)


@pytest.mark.parametrize("symmetric", [False, True], ids=["zero-points", "symmetric"])
def test_a_tied_embedding_gathers_the_lm_heads_quantized_blocks(tmp_path, symmetric, monkeypatch):
    """int4 with tied weights: no fp32 table is left, and the embedding rows GatherBlockQuantized
    gives are exactly the lm_head's dequantized columns (with zero points, or the default one). The
    whole graph then follows the same int4 export that keeps an fp32 table (the two differ only in
    the embedding rows)."""
    import numpy as np
    import onnxruntime as ort
    from conftest import build_llama
    from onnx import TensorProto, helper

    build_llama(tmp_path / "hf", tie_word_embeddings=True)
    manifest = export_model(
        str(tmp_path / "hf"),
        tmp_path / "export",
        ExportOptions(quantization=Quantization("int4", symmetric=symmetric, algorithm="rtn", keep_int8=())),
    )
    assert manifest.quantization["symmetric"] == symmetric
    graph = onnx.load(str(tmp_path / "export" / "model.onnx")).graph
    assert not [t.name for t in graph.initializer if t.data_type == TensorProto.FLOAT and sorted(t.dims) == [64, 320]]
    (gather,) = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
    (lm_head,) = [n for n in graph.node if n.op_type == "MatMulNBits" and n.input[2] == gather.input[2]]
    assert list(gather.input[2:]) == list(lm_head.input[2:4])  # scales (and zero points) shared
    assert len(gather.input) == (3 if symmetric else 4)
    (rows,) = [n for n in graph.node if n.op_type == "Reshape" and n.output[0] == gather.input[0]]
    assert rows.input[0] == lm_head.input[1]  # the embedding reads the lm_head's bytes: one copy in the file
    tensors = [t for t in graph.initializer if t.name in {*gather.input, *lm_head.input, *rows.input}]

    def run(node, inputs, outputs, before=()):
        model = helper.make_model(
            helper.make_graph([*before, node], "g", inputs, outputs, initializer=tensors),
            opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
            ir_version=10,
        )
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    gathered = run(
        gather,
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [320])],
        [helper.make_tensor_value_info(gather.output[0], TensorProto.FLOAT, None)],
        before=[rows],
    ).run(None, {"input_ids": np.arange(320)})[0]
    exact = helper.make_node(
        "MatMulNBits",
        ["eye", *lm_head.input[1:4]],
        ["columns"],
        domain="com.microsoft",
        K=64,
        N=320,
        bits=4,
        block_size=32,
        accuracy_level=0,
    )
    columns = run(
        exact,
        [helper.make_tensor_value_info("eye", TensorProto.FLOAT, [64, 64])],
        [helper.make_tensor_value_info("columns", TensorProto.FLOAT, None)],
    ).run(None, {"eye": np.eye(64, dtype=np.float32)})[0]
    assert gathered.shape == (320, 64)
    np.testing.assert_allclose(gathered, columns.T, rtol=0, atol=1e-6)
    import edgeinfer.export.quantize as quantize
    from conftest import logits_against_transformers
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(quantize, "quantized_embedding", lambda *args: False)
    monkeypatch.setattr(quantize, "quantized_table", lambda *args: False)  # the fp32 table kept
    export_model(
        str(tmp_path / "hf"),
        tmp_path / "table",
        ExportOptions(quantization=Quantization("int4", symmetric=symmetric, algorithm="rtn", keep_int8=())),
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    gathered, _ = logits_against_transformers(Engine.load(tmp_path / "export", provider="cpu"), model, [1, 40, 41, 42])
    table, _ = logits_against_transformers(Engine.load(tmp_path / "table", provider="cpu"), model, [1, 40, 41, 42])
    cosine = (gathered * table).sum(-1) / np.linalg.norm(gathered, axis=-1) / np.linalg.norm(table, axis=-1)
    assert cosine.min() >= 0.85, cosine  # measured 0.90 (zero points) and 0.94 (symmetric)


@pytest.mark.parametrize("bits, symmetric", [(4, False), (4, True), (8, False), (8, True)])
def test_an_untied_table_gathers_rows_rounded_to_nearest_in_its_own_blocks(tmp_path, monkeypatch, bits, symmetric):
    """`table.quantized_table` on a table of its own: every row GatherBlockQuantized gives is the
    fp32 row rounded to nearest in blocks along it (within half a step of the block's range), the
    bands of rows made apart join up, and the fp32 table leaves the graph."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    import edgeinfer.export.table as table_module
    from edgeinfer.export.graphs import save_graph

    rng = np.random.default_rng(0)
    table = rng.standard_normal((300, 64)).astype(np.float32) * np.linspace(0.1, 3, 300, dtype=np.float32)[:, None]
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, None])
    rows = helper.make_tensor_value_info("rows", TensorProto.FLOAT, [1, None, 64])
    gather = helper.make_node("Gather", ["table", "input_ids"], ["rows"], name="embed")
    graph = helper.make_graph([gather], "table", [ids], [rows], [numpy_helper.from_array(table, "table")])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    monkeypatch.setattr(table_module, "_ROWS_BYTES", 64 * 4 * 70)  # bands of 70 rows: 5 bands, the last short
    assert table_module.quantized_table(model.graph, tmp_path, "made.partial", bits, 32, symmetric)
    assert [n.op_type for n in model.graph.node] == ["GatherBlockQuantized"] and not any(
        t.name == "table" for t in model.graph.initializer
    )
    save_graph(model, tmp_path, weights_from=tmp_path)
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    gathered = session.run(None, {"input_ids": np.arange(300)[None]})[0][0]
    blocks = table.reshape(300, 2, 32)
    # Within half a step, a step being the block's range over its levels. Symmetric, a step is the
    # largest magnitude over half the levels (it maps to -8), and a value of the other sign as large
    # clips at +7: a whole step.
    if symmetric:
        bound = np.abs(blocks).max(-1) / 2 ** (bits - 1)
    else:
        bound = (blocks.max(-1) - blocks.min(-1)) / (2**bits - 1) / 2
    error = np.abs(gathered.reshape(300, 2, 32) - blocks)
    assert (error <= bound[..., None] + 1e-5 * np.abs(blocks).max()).all(), error.max()
    assert error.max() > 0  # rounded, not copied


def test_embedding_bits_set_an_untied_tables_blocks(tmp_path, tiny_llama):
    """The tiny llama's untied table gathers from 4-bit blocks with embedding_bits 4, 8-bit ones by
    default, and the 4-bit export's data file is smaller by the table's half bytes."""
    import shutil

    from edgeinfer.export.quantize import quantize_graph
    from edgeinfer.export.table import gathered_table

    sizes = {}
    for bits in (4, 8):
        folder = tmp_path / f"bits{bits}"
        shutil.copytree(tiny_llama[1], folder)
        settings = {"embedding_bits": 4} if bits == 4 else {}
        quantize_graph(folder, Quantization("int4", symmetric=True, **settings))
        assert gathered_table(folder) == {"bits": bits, "blocks": "own"}
        sizes[bits] = (folder / "model.onnx.data").stat().st_size
    rows, hidden = 320, 64  # the tiny llama's table
    assert sizes[8] - sizes[4] == rows * hidden // 2


def two_copies(tmp_path, tiny_llama, tied: bool):
    """(the fp32 export, two copies of it) of the tiny llama, with tied weights or not."""
    import shutil

    from conftest import build_llama

    source = tiny_llama[1]
    if tied:
        build_llama(tmp_path / "hf", tie_word_embeddings=True)
        export_model(str(tmp_path / "hf"), tmp_path / "fp32")
        source = tmp_path / "fp32"
    for copy in ("ours", "theirs"):
        shutil.copytree(source, tmp_path / copy)
    return source, tmp_path / "ours", tmp_path / "theirs"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("method, symmetric", [("int4", False), ("int4", True), ("int8", False)])
def test_one_weight_at_a_time_writes_the_quantizers_own_graph(tmp_path, tiny_llama, tied, method, symmetric):
    """quantize_graph hands ONNX Runtime's quantizer the graph without its weights and reads each
    MatMul's weight as it is quantized: the files written must be byte for byte those of the
    quantizer run as documented, on the graph with every weight loaded."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    from edgeinfer.export.graphs import save_graph, tied_embedding
    from edgeinfer.export.quantize import BITS, TABLE_BITS, quantize_graph, quantized_embedding, quantized_table

    source, ours, theirs = two_copies(tmp_path, tiny_llama, tied)
    quantization = Quantization(method, symmetric=symmetric, algorithm="rtn", keep_int8=())
    quantize_graph(ours, quantization)

    bits = BITS[method]
    model = onnx.load(str(theirs / "model.onnx"))
    found = tied_embedding(model.graph)
    assert bool(found) == tied
    quantizer = MatMulNBitsQuantizer(
        model, algo_config=DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=symmetric, accuracy_level=4, bits=bits)
    )
    quantizer.process()
    if found:
        assert quantized_embedding(quantizer.model.model.graph, *found, bits, 32)
    else:  # an untied table: edgeinfer's own rounding of it (the test above pins its rows)
        assert quantized_table(quantizer.model.model.graph, theirs, "table.partial", TABLE_BITS, 32, symmetric)
    save_graph(quantizer.model.model, theirs, weights_from=theirs)
    for name in ("model.onnx", "model.onnx.data"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    assert (ours / "model.onnx.data").stat().st_size < (source / "model.onnx.data").stat().st_size * 0.6


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hqq_one_weight_loaded_writes_the_quantizers_own_graph(tmp_path, tiny_llama, tied):
    """HQQ with the lm_head rounded apart (its blocks shared with a tied table): quantize_graph,
    which loads one weight at a time, writes byte for byte what ONNX Runtime's quantizers write
    on the graph with every weight loaded, in the same two passes."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        HQQWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    from edgeinfer.export.graphs import save_graph, tied_embedding
    from edgeinfer.export.quantize import TABLE_BITS, lm_head_node, quantize_graph, quantized_embedding, quantized_table

    _, ours, theirs = two_copies(tmp_path, tiny_llama, tied)
    quantize_graph(ours, Quantization("int4", algorithm="hqq", keep_int8=()))

    model = onnx.load(str(theirs / "model.onnx"))
    head, found = lm_head_node(model.graph), tied_embedding(model.graph)
    others = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name != head]
    rounded = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=False, accuracy_level=4, bits=4)
    first = MatMulNBitsQuantizer(model, algo_config=rounded, nodes_to_exclude=others)
    first.process()
    if found:
        assert quantized_embedding(first.model.model.graph, *found, 4, 32)
    second = MatMulNBitsQuantizer(first.model.model, bits=4, algo_config=HQQWeightOnlyQuantConfig(block_size=32, bits=4))
    second.process()
    if not found:
        assert quantized_table(second.model.model.graph, theirs, "table.partial", TABLE_BITS, 32, False)
    save_graph(second.model.model, theirs, weights_from=theirs)
    for name in ("model.onnx", "model.onnx.data"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


def test_keep_int8_lm_head_and_hqq_export_and_follow_transformers(tiny_llama, tmp_path):
    """--algorithm hqq --keep-int8 lm_head: the lm_head at 8 bits, the rest at 4, the quality in
    the manifest, and logits at least as close to transformers' as plain int4's."""
    from conftest import closeness, logits_against_transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama[0]).eval()
    cosines = {}
    for name, quantization in {
        "rtn": Quantization("int4", algorithm="rtn", keep_int8=()),
        "hqq_head8": Quantization("int4", algorithm="hqq", keep_int8=("lm_head",)),
    }.items():
        export_model(str(tiny_llama[0]), tmp_path / name, ExportOptions(quantization=quantization))
        graph = onnx.load(str(tmp_path / name / "model.onnx"), load_external_data=False).graph
        bits = {n.name: next(a.i for a in n.attribute if a.name == "bits") for n in graph.node if n.op_type == "MatMulNBits"}
        expected = 8 if quantization.keep_int8 else 4
        head = next(name for name in bits if "lm_head" in name)
        assert bits.pop(head) == expected and set(bits.values()) == {4}
        recorded = json.loads((tmp_path / name / "edgeinfer.json").read_text())["quantization"]
        assert (recorded["algorithm"], recorded["keep_int8"]) == (quantization.algorithm, list(quantization.keep_int8))
        engine = Engine.load(tmp_path / name, provider="cpu")
        cosines[name] = closeness(*logits_against_transformers(engine, model, [1, 40, 41, 42, 43]))[0]
    assert cosines["hqq_head8"] >= cosines["rtn"], cosines


def test_windowed_perplexity_is_the_same_in_pytorch_and_the_fp32_export(tiny_llama):
    """llama-perplexity's way on both sides: the same windows, the same positions scored, so the
    fp32 export's windowed log-probabilities equal PyTorch's (the tiny context holds one window:
    its second half is the whole text's)."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from edgeinfer.export.quantize import quality_reference, windowed_scores, windows

    model = AutoModelForCausalLM.from_pretrained(tiny_llama[0]).eval()
    reference = quality_reference(model, tiny_llama[1])
    engine = Engine.load(tiny_llama[1], provider="cpu")
    ours = windowed_scores(engine, reference.ids)
    assert [len(w) for w in windows(reference.ids, engine.max_context)] == [256] and len(ours) == 127
    np.testing.assert_allclose(ours, reference.windowed, atol=2e-3)
    np.testing.assert_allclose(reference.windowed, reference.scores[128:255], atol=2e-3)


@pytest.mark.parametrize("bits", [4, 8])
def test_fitted_blocks_are_what_matmulnbits_multiplies_by(bits):
    """k_quant's blocks, packed as MatMulNBits reads them, multiply exactly as the weight that
    `dequantized` says they stand for; and its search never does worse than its first candidate."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from edgeinfer.export import kquant

    rng = np.random.default_rng(0)
    weight = (rng.standard_t(4, size=(96, 40)) * 0.05).astype(np.float32)
    levels, scales, zeros = kquant.fit(weight, bits, 32)
    packed, packed_zeros = kquant.pack(levels, zeros, bits)
    tensors = [numpy_helper.from_array(a, n) for a, n in ((packed, "B"), (scales, "S"), (packed_zeros, "Z"))]
    node = helper.make_node("MatMulNBits", ["x", "B", "S", "Z"], ["y"], domain="com.microsoft", K=96, N=40, bits=bits, block_size=32)
    model = helper.make_model(
        helper.make_graph(
            [node],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 96])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
            initializer=tensors,
        ),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
        ir_version=10,
    )
    x = rng.standard_normal((3, 96)).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x @ kquant.dequantized(levels, scales, zeros), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(kquant.dequantized(levels, scales, zeros, columns=7), kquant.dequantized(levels, scales, zeros))
    error = np.mean((kquant.dequantized(levels, scales, zeros) - weight) ** 2)
    top = 2**bits - 1
    lo, hi = (
        np.minimum(weight.T.reshape(40, 3, 32).min(-1, keepdims=True), 0),
        np.maximum(weight.T.reshape(40, 3, 32).max(-1, keepdims=True), 0),
    )
    step = (hi - lo) / top
    zero = np.round(-lo / step)
    rounded = step * (np.clip(np.round(weight.T.reshape(40, 3, 32) / step) + zero, 0, top) - zero)
    assert error < np.mean((rounded.reshape(40, 96).T - weight) ** 2)  # below round-to-nearest's


def test_gptq_spreads_the_error_so_the_layer_output_moves_less(tmp_path, monkeypatch):
    """On activations with correlated channels, GPTQ's layer output error over them is below
    k_quant's; fitted in the caller's array (`overwrite`) and kept on disk ahead of its pass
    (`FittedBlocks`), or in parts of its output columns (a wide lm_head), its blocks are the same."""
    import numpy as np

    from edgeinfer.export import kquant

    rng = np.random.default_rng(1)
    x = rng.standard_normal((2048, 64)) @ rng.standard_normal((64, 64)).astype(np.float32)
    weight = (rng.standard_normal((64, 48)) * 0.05).astype(np.float32)
    hessian = x.T @ x / len(x)
    out = {}
    for name, blocks in (("fit", kquant.fit(weight, 4, 32)), ("gptq", kquant.gptq(weight, hessian, 4, 32))):
        out[name] = np.mean((x @ kquant.dequantized(*blocks) - x @ weight) ** 2)
    assert out["gptq"] < 0.8 * out["fit"], out
    x = rng.standard_normal((1024, 256)).astype(np.float32)  # channels past GPTQ's first 128 take its errors
    weight, hessian = (rng.standard_normal((256, 48)) * 0.05).astype(np.float32), x.T @ x / len(x)
    worked_in = weight.copy()
    kept = kquant.FittedBlocks(tmp_path / "fitted")
    kept["w"] = kquant.fit_weight(worked_in, 4, 32, None, hessian, overwrite=True)
    assert not np.array_equal(worked_in, weight)  # worked in, not copied
    assert all(np.array_equal(a, b) for a, b in zip(kept.pop("w"), kquant.gptq(weight, hessian, 4, 32)))
    assert kept.pop("w") is None and not list((tmp_path / "fitted").iterdir())
    wide = (rng.standard_normal((256, 300)) * 0.05).astype(np.float32)
    whole = kquant.gptq(wide, hessian, 4, 32)
    monkeypatch.setattr(kquant, "_rows_within", lambda columns: 96)  # fitted in parts of 96 output columns
    assert all(np.array_equal(a, b) for a, b in zip(kquant.fit_weight(wide, 4, 32, None, hessian), whole))


@pytest.mark.parametrize("algorithm", ["k_quant", "gptq"])
def test_calibrated_exports_keep_the_named_matmuls_at_int8(tiny_llama, tmp_path, algorithm):
    """k_quant with a calibration text and gptq (its default text): the export loads, generates, is
    scored, and the MatMuls --keep-int8 names (the lm_head, layer 0's down_proj) are at 8 bits."""
    text = tmp_path / "calibration.txt"
    text.write_text("The lighthouse keeper climbed the stairs and looked out over the grey water. " * 20)
    quantization = Quantization(
        "int4", algorithm=algorithm, keep_int8=("lm_head", "down_proj:0"), calibration=str(text) if algorithm == "k_quant" else None
    )
    manifest = export_model(str(tiny_llama[0]), tmp_path / "q", ExportOptions(quantization=quantization))
    graph = onnx.load(str(tmp_path / "q" / "model.onnx"), load_external_data=False).graph
    bits = {n.name: next(a.i for a in n.attribute if a.name == "bits") for n in graph.node if n.op_type == "MatMulNBits"}
    eight = sorted(name for name, b in bits.items() if b == 8)
    assert len(eight) == 2 and any("lm_head" in n for n in eight) and any("layers.0/mlp/down_proj" in n for n in eight), eight
    assert not (tmp_path / "q" / "calibration").exists()
    assert manifest.quantization["algorithm"] == algorithm and 0 < manifest.quantization["top1_agreement"] <= 1
    result = Engine.load(tmp_path / "q", provider="cpu").generate("hello", max_new_tokens=4, ignore_eos=True)
    assert len(result.token_ids) == 4 and result.finish_reason == "length"


def test_the_auto_choice_measures_each_module_by_its_own_weights(tmp_path, tiny_llama):
    """A module whose weights the rounding wrecks (zeroed) costs the most, and only it: the others,
    left exact, cost nothing; a tied table follows its lm_head."""
    from edgeinfer.export.quantize import matmul_role
    from edgeinfer.export.sensitivity import modules_by_cost

    _, tied, _ = two_copies(tmp_path, tiny_llama, tied=True)
    ids = list(range(5, 200))
    for export, wrecked in ((tiny_llama[1], "down_proj"), (tied, "lm_head")):
        graph = onnx.load(str(Path(export) / "model.onnx"), load_external_data=False).graph
        modules = {n.input[1]: matmul_role(n.name)[1] for n in graph.node if n.op_type == "MatMul"}
        costs = modules_by_cost(
            export, ids, matmul_role, lambda weight, _input, name: weight * 0 if modules[name] == wrecked else weight
        )
        by_module = {module: kld for module, kld, _ in costs}
        assert costs[0][0] == wrecked and by_module[wrecked] > 0.01, costs
        assert all(abs(kld) < 1e-6 for module, kld in by_module.items() if module != wrecked), costs
        assert not (Path(export) / "sensitivity.onnx").exists()


def test_the_auto_choice_keeps_the_costliest_per_byte_within_the_budget():
    from edgeinfer.export.sensitivity import BUDGET, chosen

    # (module, KL divergence, bytes 8 bits add): 200 weights, 128 bytes at 4 bits (block 32), 38.4 to add
    costs = [("o_proj", 0.01, 10), ("lm_head", 0.5, 60), ("up_proj", 0.05, 10), ("qkv_proj", 0.2, 20)]
    assert BUDGET == 0.3
    assert chosen(costs, 32) == ["qkv_proj", "up_proj"]  # lm_head's 60 never fits; o_proj's 10 no longer does
    assert chosen(costs, 128) == ["qkv_proj", "up_proj"]
    assert chosen([("lm_head", 0.5, 30), ("qkv_proj", 0.2, 30), ("o_proj", 0.01, 40)], 32) == ["lm_head"]


def test_a_weight_read_twice_is_kept_at_8_bits_for_both_readers():
    """A looped model (Dory) runs a layer's modules again on the same weights: torch.onnx names the
    second call q_proj_1. Keeping q_proj at 8 bits keeps its second reader there too; quantized
    at 8 and 4 bits, the weight's two sets of scales went under one name and ONNX Runtime refused
    the file."""
    from onnx import TensorProto, helper

    from edgeinfer.export.quantize import kept_int8

    names = [
        "/model/layers.1/self_attn/q_proj/MatMul",
        "/model/layers.1/self_attn/q_proj_1/MatMul",
        "/model/layers.1/mlp/up_proj/MatMul",
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w_q"], ["a"], name=names[0]),
        helper.make_node("MatMul", ["a", "w_q"], ["b"], name=names[1]),
        helper.make_node("MatMul", ["b", "w_up"], ["y"], name=names[2]),
    ]
    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph(nodes, "looped", [value], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    assert kept_int8(graph, ["q_proj"]) == names[:2]
    assert kept_int8(graph, ["q_proj_1"]) == [names[1], names[0]]
    assert kept_int8(graph, ["up_proj"]) == names[2:]


def test_keep_int8_auto_writes_what_naming_its_choice_writes(tmp_path, tiny_llama):
    """gptq with --keep-int8 auto: the modules chosen are recorded in the manifest, and the files are
    byte for byte those of an export that names them (the blocks the measure fitted are reused)."""
    from edgeinfer.export.quantize import quantize_graph

    _, auto, named = two_copies(tmp_path, tiny_llama, tied=False)
    done = quantize_graph(auto, Quantization("int4", algorithm="gptq", keep_int8=("auto",)))
    assert not any((Path(auto) / left).exists() for left in ("quantized.partial", "calibration"))  # its scratch removed
    assert (
        done.keep_int8
        and "auto" not in done.keep_int8
        and set(done.keep_int8) <= {"lm_head", "qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    )
    quantize_graph(named, Quantization("int4", algorithm="gptq", keep_int8=done.keep_int8))
    for name in ("model.onnx", "model.onnx.data"):
        assert (auto / name).read_bytes() == (named / name).read_bytes(), name
    graph = onnx.load(str(auto / "model.onnx"), load_external_data=False).graph
    eight = {n.name for n in graph.node if n.op_type == "MatMulNBits" and next(a.i for a in n.attribute if a.name == "bits") == 8}
    assert eight and {_role_of_node(n) for n in eight} == set(done.keep_int8)


def _role_of_node(name):
    from edgeinfer.export.quantize import matmul_role

    return matmul_role(name.removesuffix("_Q8").removesuffix("_Q4"))[1]


def test_windows_start_with_bos_where_the_tokenizer_starts_a_text_with_it():
    """llama-perplexity puts BOS in place of each window's first token where the model's tokenizer
    starts a text with it (Gemma's), and leaves the windows as cut where it does not (SmolLM2's)."""
    from types import SimpleNamespace

    from edgeinfer.export.quantize import leading_bos, windows

    text = list(range(10, 610))
    assert windows(text, 4096) == [text[:256], text[256:512]] and windows(text, 100)[1] == text[100:200]
    manifest = SimpleNamespace(bos_token_id=2)
    assert leading_bos(text, manifest) is None and leading_bos([2, *text], manifest) == 2
    with_bos = windows([2, *text], 4096, leading_bos([2, *text], manifest))
    assert with_bos == [[2, *text[:255]], [2, *text[256:511]]]  # the second window's first token (text[255]) replaced
