"""The resident-memory trade-off of a tied embedding in an fp32 export: the export as edgeinfer
writes it (the embedding table and the lm_head weight stored apart) against a variant whose
embedding Gather reads the lm_head's weight (one tensor: Gather on axis 1, then Transpose).

    python benchmarks/investigations/tied_embedding.py EXPORT [--rounds 2]

EXPORT: an fp32 export of a model with tied weights (SmolLM2, Gemma 3). Each load runs in its own
process, the two alternating: resident memory over the interpreter after load and after a
generation of 64 tokens on a 20-sentence prompt, the data file's size, and whether the tokens are
equal."""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE = """
import json, sys, psutil
proc = psutil.Process(); base = proc.memory_info().rss
from edgeinfer import Engine
engine = Engine.load(sys.argv[1], provider="cpu", threads=2, prefix_cache=0)
loaded = proc.memory_info().rss - base
prompt = " ".join(f"item {k} is {k * 7 % 13}." for k in range(20))
tokens = engine.generate(prompt, max_new_tokens=64, ignore_eos=True).token_ids
print(json.dumps({"after_load_mib": loaded / 2**20, "after_generation_mib": (proc.memory_info().rss - base) / 2**20,
                  "tokens": tokens}))
"""


def tied_variant(src: Path, dst: Path) -> None:
    import onnx
    from onnx import helper

    from edgeinfer.export.graphs import GRAPH_FILE, save_graph, tied_embedding

    model = onnx.load(str(src / GRAPH_FILE))
    found = tied_embedding(model.graph)
    if found is None:
        sys.exit(f"{src}: its embedding is not the lm_head's weight transposed (untied weights): nothing to compare")
    gather, weight = found
    position = list(model.graph.node).index(gather)
    model.graph.node.remove(gather)
    model.graph.node.insert(position, helper.make_node("Gather", [weight, gather.input[1]], ["tied_columns"], axis=1))
    model.graph.node.insert(position + 1, helper.make_node("Transpose", ["tied_columns"], [gather.output[0]], perm=[1, 2, 0]))
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == gather.input[0]))
    save_graph(model, dst)
    for path in src.iterdir():
        if path.is_file() and not path.name.startswith(GRAPH_FILE):
            shutil.copy(path, dst / path.name)
    manifest = json.loads((dst / "edgeinfer.json").read_text())
    (dst / "edgeinfer.json").write_text(json.dumps({**manifest, "files": {}}))  # sizes changed: not checked


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("export", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        tied = Path(scratch)
        tied_variant(args.export, tied)
        sizes = {"apart": (args.export / "model.onnx.data").stat().st_size, "tied": (tied / "model.onnx.data").stat().st_size}
        runs = {"apart": [], "tied": []}
        for _ in range(args.rounds):
            for name, folder in (("apart", args.export), ("tied", tied)):
                done = subprocess.run([sys.executable, "-c", MEASURE, str(folder)], capture_output=True, text=True, check=True)
                runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    for name, results in runs.items():
        loads = ", ".join(f"{r['after_load_mib']:.0f}" for r in results)
        generated = ", ".join(f"{r['after_generation_mib']:.0f}" for r in results)
        print(f"{name}: data file {sizes[name] / 2**20:.0f} MiB; resident after load {loads} MiB, after 64 tokens {generated} MiB")
    print("tokens equal:", all(r["tokens"] == runs["apart"][0]["tokens"] for rs in runs.values() for r in rs))


if __name__ == "__main__":
    main()
