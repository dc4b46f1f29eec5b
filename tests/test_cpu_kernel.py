"""edgeinfer's kernel for quantized weights on the CPU (sdk/cpu_kernel.py, sdk/kernels/block_matmul.c)
against ONNX Runtime's MatMulNBits on the same 4- and 8-bit weights: the same products within
MatMulNBits' own error, alone and in a session that loads an export's graph rewritten for it. Skipped where the kernel cannot be
built (no AVX-512 VNNI, no C compiler); there the graphs run as exported, which the rest of the
suite covers."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import convert_model_to_external_data

from edgeinfer.sdk import cpu_kernel
from edgeinfer.sdk.runtime import Graph

BUILT = cpu_kernel.kernel()
pytestmark = pytest.mark.skipif(BUILT.path is None, reason=f"edgeinfer's CPU kernel is not built here: {BUILT.reason}")


def weights(k: int, n: int, symmetric: bool, seed: int = 0, bits: int = 4):
    """MatMulNBits' B, scales and zero points for random blocks of `bits`, and W [K, N] they stand for."""
    rng = np.random.default_rng(seed)
    blocks, levels = k // 32, 2**bits
    q = rng.integers(0, levels, (n, blocks, 32), dtype=np.uint8)
    s = (rng.uniform(0.005, 0.05, (n, blocks)) * 16 / levels).astype(np.float32)
    z = np.full((n, blocks), levels // 2, np.uint8) if symmetric else rng.integers(0, levels, (n, blocks), dtype=np.uint8)
    w = ((q.astype(np.float64) - z[:, :, None]) * s[:, :, None]).reshape(n, k).T
    if bits == 8:
        return q, s.reshape(-1), None if symmetric else z.reshape(-1), w
    b = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).astype(np.uint8)
    padded = np.pad(z, ((0, 0), (0, blocks % 2)))
    zeros = None if symmetric else (padded[:, 0::2] | (padded[:, 1::2] << 4)).astype(np.uint8).reshape(-1)
    return b, s.reshape(-1), zeros, w


def matmulnbits(k: int, n: int, b, scales, zeros, name: str = "B", bits: int = 4) -> tuple[list, object]:
    """Initializers and the MatMulNBits node of y = x . W, as export writes them."""
    inputs = [numpy_helper.from_array(b, name), numpy_helper.from_array(scales, f"{name}_scales")]
    if zeros is not None:
        inputs.append(numpy_helper.from_array(zeros, f"{name}_zeros"))
    node = helper.make_node(
        "MatMulNBits",
        ["x", *[t.name for t in inputs]],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=32,
        accuracy_level=4,
    )
    return inputs, node


def model(k: int, n: int, b, scales, zeros, bits: int = 4):
    initializers, node = matmulnbits(k, n, b, scales, zeros, bits=bits)
    bias = numpy_helper.from_array(np.linspace(-1, 1, n).astype(np.float32), "bias")  # read by a plain op: stays in the data file
    graph = helper.make_graph(
        [node, helper.make_node("Add", ["y", "bias"], ["out"])],
        "int4",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["rows", n])],
        [*initializers, bias],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)], ir_version=8)


def relative_error(y, exact) -> float:
    return float(np.abs(y - exact).max() / np.abs(exact).max())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k,n", [(64, 16), (96, 48), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 13])
def test_the_kernel_multiplies_as_matmulnbits_does(k, n, rows, symmetric, bits):
    """Against the exact product of the 4-bit weights, the kernel's error is MatMulNBits' own (int8
    activations in blocks of 32) within a quarter, and the two products agree within a fifth of it
    (what is left is the kernel's fp16 scales)."""
    b, scales, zeros, w = weights(k, n, symmetric, bits=bits)
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    exact = x.astype(np.float64) @ w
    theirs = ort.InferenceSession(model(k, n, b, scales, zeros, bits).SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = theirs.run(None, {"x": x})[0] - np.linspace(-1, 1, n).astype(np.float32)
    packed = cpu_kernel.pack(BUILT.path, b, scales, zeros, k, n, bits)
    ours = cpu_kernel.matmul(BUILT.path, packed, x, k, n, bits, symmetric)
    assert relative_error(ours, exact) <= 1.25 * relative_error(theirs, exact) + 1e-4
    assert relative_error(ours, theirs) <= 0.2 * relative_error(theirs, exact) + 1e-5
    assert relative_error(theirs, exact) < 0.02  # the tolerance above is a small one


def test_the_packed_layout_is_the_one_the_kernel_reads():
    """Column c of block 0 in the first group: step t's byte 4c + j holds row 4t + j's value, in
    the low nibble for even steps, then the fp16 scale and scale x zero point."""
    k, n = 64, 16
    b, scales, zeros, _ = weights(k, n, symmetric=False)
    packed = cpu_kernel.pack(BUILT.path, b, scales, zeros, k, n, 4)
    assert packed.size == cpu_kernel.packed_size(k, n, 4, symmetric=False) == 1 * 2 * 320
    q = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, 2, 32)
    first = packed[:320]
    for c in (0, 5, 15):
        for row in (0, 7, 13, 31):
            step, j = divmod(row, 4)
            byte = first[64 * (step // 2) + 4 * c + j]
            assert (byte >> (4 * (step % 2))) & 0x0F == q[c, 0, row]
        assert first[256:288].view(np.float16)[c] == np.float16(scales[c * 2])
        z = zeros.reshape(n, 1)[c, 0] & 0x0F
        assert first[288:320].view(np.float16)[c] == np.float16(scales[c * 2] * z)


@pytest.mark.parametrize("symmetric", [False, True])
def test_a_session_runs_the_graph_rewritten_for_the_kernel(tmp_path, symmetric, monkeypatch):
    """An export-like graph file with its weights in a data file: the session runs
    edgeinfer.BlockMatMul over weights packed at load (MatMulNBits' copies are not loaded; the
    bias, read by a plain op, still comes from the data file), and gives MatMulNBits' product
    within its error. With EDGEINFER_CPU_KERNEL=0 the graph runs as exported, exactly."""
    k, n = 576, 1536
    b, scales, zeros, w = weights(k, n, symmetric, seed=3)
    onnx_model = model(k, n, b, scales, zeros)
    convert_model_to_external_data(onnx_model, all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=0)
    import onnx

    onnx.save(onnx_model, tmp_path / "model.onnx")
    x = np.random.default_rng(9).standard_normal((5, k)).astype(np.float32)
    exact = x.astype(np.float64) @ w + np.linspace(-1, 1, n)
    plain = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    graph = Graph(tmp_path / "model.onnx", "cpu", threads=2, quantized=True)
    assert graph.weights_kernel.startswith("edgeinfer's kernel (1 weights")
    ours = graph.run({"x": x}, on_device=[], to_host=["out"])[1]["out"]
    assert relative_error(ours, exact) <= 1.25 * relative_error(plain, exact) + 1e-4

    monkeypatch.setenv(cpu_kernel.SWITCH_ENV, "0")
    cpu_kernel.kernel.cache_clear()
    try:
        exported = Graph(tmp_path / "model.onnx", "cpu", threads=2, quantized=True)
        assert exported.weights_kernel == f"MatMulNBits: edgeinfer's kernel is off ({cpu_kernel.SWITCH_ENV}=0)"
        assert np.array_equal(exported.run({"x": x}, on_device=[], to_host=["out"])[1]["out"], plain)
    finally:
        monkeypatch.delenv(cpu_kernel.SWITCH_ENV)
        cpu_kernel.kernel.cache_clear()


def test_nodes_the_kernel_does_not_compute_the_same_way_stay_matmulnbits(tmp_path):
    """Blocks of 64, fp32 arithmetic (accuracy level 0) and fp16 activations (an fp16 export's, whose
    scales are fp16) keep MatMulNBits: no node is rewritten."""
    import onnx

    k, n = 128, 32
    b, scales, zeros, _ = weights(k, n, symmetric=False)
    for attribute, value in (("block_size", 64), ("accuracy_level", 0), ("scales", None)):
        onnx_model = model(k, n, b, scales.astype(np.float16) if attribute == "scales" else scales, zeros)
        node = onnx_model.graph.node[0]
        if value is not None:
            next(a for a in node.attribute if a.name == attribute).i = value
        path = tmp_path / f"{attribute}.onnx"
        onnx.save(onnx_model, path)
        assert cpu_kernel.rewrite(path, BUILT.path) is None
    onnx.save(model(k, n, b, scales, zeros), tmp_path / "taken.onnx")
    assert cpu_kernel.rewrite(tmp_path / "taken.onnx", BUILT.path) is not None  # the same graph as exported is taken
