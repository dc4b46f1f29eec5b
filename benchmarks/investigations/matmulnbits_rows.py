"""What ONNX Runtime's MatMulNBits costs per call as the rows grow (one decode stream is M = 1, eight
streams M = 8), for each bit width, block size, accuracy level and zero-point scheme export can
write, beside fp32's MatMul: a chain of `--layers` pairs of MatMuls of a model's MLP shapes ([K, N]
then [N, K], SmolLM2's 576 and 1536 by default), quantized by ONNX Runtime's own quantizer (round
to nearest), timed on the CPU provider with `--threads` intra-op threads, the configurations
alternated over `--rounds`, medians.

    python benchmarks/investigations/matmulnbits_rows.py [--k 576] [--n 1536] [--rows 1,8,32] [--rounds 5]

Prints microseconds per MatMul, the cost of M rows over one row's, and at M = 1 the bytes each
MatMul reads (weights, scales, zero points) over its time: GB/s, to hold against the machine's
bandwidth once the chain outgrows the caches (1.5B shapes: `--k 1536 --n 8960 --layers 4`).
Figures, never asserted."""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np

CONFIGS = [  # (bits, block size, accuracy level, symmetric); bits 32 is fp32's MatMul
    (4, 32, 4, False),
    (4, 64, 4, False),
    (4, 128, 4, False),
    (4, 32, 4, True),
    (4, 64, 4, True),
    (4, 32, 0, False),
    (8, 32, 4, False),
    (32, 0, 0, False),
]


def chain(k: int, n: int, layers: int, bits: int, block: int, level: int, symmetric: bool) -> tuple[bytes, int]:
    """The chain's model and the bytes of its weights (with their scales and zero points)."""
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    rng = np.random.default_rng(0)
    nodes, weights, x = [], [], "x"
    for i in range(layers):
        for name, shape, out in ((f"up{i}", (k, n), f"h{i}"), (f"down{i}", (n, k), f"y{i}")):
            weights.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.05).astype(np.float32), name))
            nodes.append(helper.make_node("MatMul", [x, name], [out], name=f"{name}/MatMul"))
            x = out
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["rows", k])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    if bits < 32:
        config = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=symmetric, accuracy_level=level, bits=bits)
        quantizer = MatMulNBitsQuantizer(model, block_size=block, is_symmetric=symmetric, accuracy_level=level, algo_config=config)
        quantizer.process()
        model = quantizer.model.model
    weight_bytes = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    return model.SerializeToString(), weight_bytes


def per_call_us(session, rows: int, k: int, calls: int, repeats: int = 20) -> float:
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    for _ in range(3):
        session.run(None, {"x": x})
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, {"x": x})
        times.append(time.perf_counter() - start)
    return statistics.median(times) / calls * 1e6


def main() -> None:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=576)
    parser.add_argument("--n", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    logging.disable(logging.INFO)  # the quantizer logs every MatMul it packs
    rows = [int(r) for r in args.rows.split(",")]
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    sessions, weight_bytes = {}, {}
    for c in CONFIGS:
        model, weight_bytes[c] = chain(args.k, args.n, args.layers, *c)
        sessions[c] = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    figures = {(c, m): [] for c in CONFIGS for m in rows}
    for _ in range(args.rounds):
        for config, session in sessions.items():
            for m in rows:
                figures[config, m].append(per_call_us(session, m, args.k, 2 * args.layers))
    print(
        "| bits | block | accuracy level | zero points | "
        + " | ".join(f"M={m} us" for m in rows)
        + " | "
        + " | ".join(f"M={m}/M=1" for m in rows[1:])
        + " | MB a call | GB/s at M=1 |"
    )
    print("|---:|---:|---:|---|" + "---:|" * (2 * len(rows) + 1))
    for config in CONFIGS:
        bits, block, level, symmetric = config
        us = [statistics.median(figures[config, m]) for m in rows]
        per_call = weight_bytes[config] / (2 * args.layers)
        print(
            f"| {bits} | {block or '-'} | {level} | {'none' if symmetric or bits == 32 else f'uint{bits}'} | "
            + " | ".join(f"{u:.1f}" for u in us)
            + " | "
            + " | ".join(f"{u / us[0]:.2f}" for u in us[1:])
            + f" | {per_call / 1e6:.2f} | {per_call / us[0] / 1e3:.1f} |"
        )


if __name__ == "__main__":
    main()
