"""Does mobius-onnx (ONNX Runtime's team's graph builder) give a hybrid model's graph that matches
transformers 5? A tiny random qwen3_5 (gated DeltaNet linear attention on three layers of four,
full attention on the fourth) is built from transformers' own config, saved, and built by
`mobius.build`; the graph's ops are counted; the linear layers' state inputs and outputs are
declared again with the shapes the ops take (see below); then ONNX Runtime's CPU provider runs a
prefill, a decode step by step on the state it hands back (teacher-forced on one sequence), the
whole sequence in one prefill and in two chunks, each against transformers' logits.

It runs in the project's environment with the export extra (transformers 5), plus mobius-onnx:

    pip install mobius-onnx==0.1.0
    python benchmarks/investigations/mobius_hybrid.py [--folder /tmp/mobius-qwen3_5]
    python benchmarks/investigations/mobius_hybrid.py --families llama qwen3 gemma3_text gemma4_text ...

Prints the ops and the largest logits differences; with `--families`, for each model type a tiny
random model from its transformers config (4 layers, hidden size 64), built by mobius and run once
over a prompt of 6 tokens with an empty past, against transformers' logits. Figures, never asserted;
what it printed is in docs/export.md ("Towards transformers 5").

mobius declares the linear layers' state (`past_key_values.N.key/value`, `present.N.*`) with
attention shapes, which ONNX Runtime refuses: `build` declares them again with the shapes the ops
take ([batch, conv channels, kernel - 1] and [batch, value heads, key dim, value dim]).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import numpy as np


SMALL = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    pad_token_id=0,
)  # the tiny models' sizes (the tests' llama's)


def build(folder: Path):
    """The tiny qwen3_5 saved in `folder`, and the path of mobius's graph of it (its states re-declared)."""
    import mobius
    import onnx
    import torch
    from onnx import TensorProto, helper
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        **SMALL,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    package = mobius.build(str(folder), task="text-generation")
    print("ops:", dict(Counter(f"{n.op_type}{'@' + n.domain if n.domain else ''}" for n in package["model"].graph)))
    package.save(str(folder / "onnx"))
    model = onnx.load(str(folder / "onnx" / "model.onnx"), load_external_data=False)
    conv = 2 * config.linear_num_key_heads * config.linear_key_head_dim + config.linear_num_value_heads * config.linear_value_head_dim
    shapes = {
        "key": ["batch", conv, config.linear_conv_kernel_dim - 1],
        "value": ["batch", config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim],
    }
    for value in [*model.graph.input, *model.graph.output]:
        parts = value.name.split(".")
        if parts[0] in ("past_key_values", "present") and config.layer_types[int(parts[-2])] == "linear_attention":
            value.type.CopyFrom(helper.make_tensor_type_proto(TensorProto.FLOAT, shapes[parts[-1]]))
    onnx.save(model, str(folder / "onnx" / "declared.onnx"))
    return folder / "onnx" / "declared.onnx"


def compare(folder: Path, graph: Path) -> None:
    import onnxruntime as ort
    import torch
    from transformers import AutoModelForCausalLM

    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    seq = np.array([[5, 17, 42, 7, 99, 3, 95, 296, 214, 304, 219, 12]], np.int64)
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(folder).eval()(torch.tensor(seq)).logits.numpy()
    empty = {
        i.name: np.zeros([1 if d == "batch" else 0 if isinstance(d, str) else d for d in i.shape], np.float32)
        for i in session.get_inputs()[3:]
    }

    def run(ids, past, start):
        positions = np.arange(start, start + ids.shape[1])[None]
        out = session.run(
            None, {"input_ids": ids, "attention_mask": np.ones((1, start + ids.shape[1]), np.int64), "position_ids": positions, **past}
        )
        state = dict(zip(names, out))
        return out[0], {name: state[name.replace("past_key_values", "present")] for name in past}

    logits, past = run(seq[:, :6], empty, 0)
    print(f"prefill of 6: {np.abs(logits - reference[:, :6]).max():.2e}")
    for t in range(6, seq.shape[1]):
        logits, past = run(seq[:, t : t + 1], past, t)
        print(f"decode at {t}: {np.abs(logits[0, -1] - reference[0, t]).max():.2e}")
    print(f"whole prefill: {np.abs(run(seq, empty, 0)[0] - reference).max():.2e}")
    _, first = run(seq[:, :6], empty, 0)
    print(f"two chunks: {np.abs(run(seq[:, 6:], first, 6)[0] - reference[:, 6:]).max():.2e}")


def sweep(families: list[str], root: Path) -> None:
    """Each model type's tiny model through mobius, one prefill against transformers' logits."""
    import mobius
    import onnxruntime as ort
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = np.array([[5, 17, 42, 7, 99, 3]], np.int64)
    for family in families:
        folder = root / family
        folder.mkdir(parents=True, exist_ok=True)
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **SMALL)).eval()
            model.save_pretrained(folder)
            mobius.build(str(folder), task="text-generation").save(str(folder / "onnx"))
            session = ort.InferenceSession(str(folder / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
            given = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None]}
            feeds = {
                i.name: given.get(
                    i.name, np.zeros([1 if d == "batch" else 0 if isinstance(d, str) else d for d in i.shape], np.float32)
                )
                for i in session.get_inputs()
            }
            ours = session.run(None, feeds)[0]
            with torch.no_grad():
                reference = model(torch.tensor(ids)).logits.numpy()
            print(f"{family}: largest difference {np.abs(ours - reference).max():.2e}")
        except Exception as e:  # noqa: BLE001 - a survey: whatever fails, says so and goes on to the next type
            print(f"{family}: {type(e).__name__}: {str(e)[:160]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/mobius-qwen3_5"))
    parser.add_argument("--families", nargs="*", default=None, metavar="MODEL_TYPE")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    if args.families:
        return sweep(args.families, args.folder)
    compare(args.folder, build(args.folder))


if __name__ == "__main__":
    main()
