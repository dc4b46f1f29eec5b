"""One decode step of ONNX Runtime's LinearAttention (com.microsoft, the gated rule a Mamba-2 mixer
runs) at a mixer's shape, alone in a graph: its state's present bound to its past (in place, as the
runtime binds it) against bound apart, beside an Identity that copies the state.

    python benchmarks/linear_attention_step.py [--heads 48] [--key 128] [--value 64] [--groups 1] [--rounds 2]

The defaults are Granite 4.0-H-1B's mixer (48 heads, a state of 128 x 64 each, one group of B and
C). Prints microseconds a step per round (400 steps after 20 of warm-up, 2 threads)."""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper


def _graph(nodes, inputs: dict, outputs: dict):
    def value(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    graph = helper.make_graph(nodes, "g", [value(n, s) for n, s in inputs.items()], [value(n, s) for n, s in outputs.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9  # what ONNX Runtime 1.31 reads
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def step_time(session, feeds: dict, state, present) -> float:
    """Microseconds a run, with `state` bound as the past and `present` as the present."""
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    binding.bind_ortvalue_input("s", state)
    binding.bind_ortvalue_output("ps", present)
    for output in session.get_outputs():
        if output.name != "ps":
            binding.bind_output(output.name)
    for _ in range(20):
        session.run_with_iobinding(binding)
    start, runs = time.perf_counter(), 400
    for _ in range(runs):
        session.run_with_iobinding(binding)
    return (time.perf_counter() - start) / runs * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=48)
    parser.add_argument("--key", type=int, default=128, help="the state's key size (a Mamba-2 mixer's state size)")
    parser.add_argument("--value", type=int, default=64, help="the state's value size (a Mamba-2 mixer's head size)")
    parser.add_argument("--groups", type=int, default=1, help="key and query heads (a Mamba-2 mixer's groups of B and C)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    h, k, v, g = args.heads, args.key, args.value, args.groups
    state_shape = [1, h, k, v]
    op = helper.make_node(
        "LinearAttention",
        ["q", "k", "v", "s", "g"],
        ["o", "ps"],
        domain="com.microsoft",
        q_num_heads=g,
        kv_num_heads=h,
        scale=1.0,
        update_rule="gated",
    )
    inputs = {"q": [1, 1, g * k], "k": [1, 1, g * k], "v": [1, 1, h * v], "s": state_shape, "g": [1, 1, h]}
    attention = _graph([op], inputs, {"o": [1, 1, h * v], "ps": state_shape})
    copy = _graph([helper.make_node("Identity", ["s"], ["ps"])], {"s": state_shape}, {"ps": state_shape})
    rng = np.random.default_rng(0)
    feeds = {name: rng.normal(size=shape).astype(np.float32) for name, shape in inputs.items() if name not in ("s", "g")}
    feeds["g"] = np.full(inputs["g"], -0.01, np.float32)
    state, apart = (ort.OrtValue.ortvalue_from_numpy(np.zeros(state_shape, np.float32)) for _ in range(2))
    for round_ in range(1, args.rounds + 1):
        print(
            f"round {round_}: LinearAttention in place {step_time(attention, feeds, state, state):.1f} us, "
            f"apart {step_time(attention, feeds, state, apart):.1f} us; "
            f"Identity copy of the state {step_time(copy, {}, state, apart):.1f} us"
        )


if __name__ == "__main__":
    main()
