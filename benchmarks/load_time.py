"""Load time against onnxruntime-genai's, each load in a fresh process, alternating, medians.

    python benchmarks/load_time.py EXPORT [--genai-python GENAI_VENV/bin/python] [--genai-model GENAI_DIR] [--rounds 5]

EXPORT: an edgeinfer export; GENAI_DIR: the same checkpoint through onnxruntime-genai's builder (by
default the fp32 model benchmarks/peers.py builds under ~/.cache/edgeinfer-peers, in the environment
it makes there; run peers.py once first), its decoder pinned to 2 intra-op threads and 1 inter-op thread, as
edgeinfer loads here. Times `Engine.load` (the graph's session, the logits heads, the tokenizer)
against genai's `og.Model` and `og.Model` + `og.Tokenizer`, the imports left out."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

EDGEINFER = """
import json, sys, time
from edgeinfer import Engine
start = time.perf_counter()
Engine.load(sys.argv[1], provider="cpu", threads=2)
print(json.dumps({"load": time.perf_counter() - start}))
"""
GENAI = """
import json, sys, time
import onnxruntime_genai as og
start = time.perf_counter()
model = og.Model(sys.argv[1])
loaded = time.perf_counter()
og.Tokenizer(model)
print(json.dumps({"load": loaded - start, "with_tokenizer": time.perf_counter() - start}))
"""


def pin_threads(folder: Path) -> None:
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["decoder"].setdefault("session_options", {}).update(intra_op_num_threads=2, inter_op_num_threads=1)
    (folder / "genai_config.json").write_text(json.dumps(config, indent=4))


def timed(python: str, code: str, folder: Path) -> dict:
    """The load's own time, and the whole process's (interpreter, imports, load and exit)."""
    start = time.perf_counter()
    done = subprocess.run([python, "-c", code, str(folder)], capture_output=True, text=True, check=True)
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "process": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("export", type=Path)
    root = Path(os.environ.get("PEERS_ROOT", "~/.cache/edgeinfer-peers")).expanduser()
    parser.add_argument("--genai-python", default=str(root / "peers-genai" / "bin" / "python"))
    parser.add_argument("--genai-model", type=Path, default=root / "peers-genai-fp32")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    pin_threads(args.genai_model)
    ours, theirs = [], []
    timed(sys.executable, EDGEINFER, args.export), timed(args.genai_python, GENAI, args.genai_model)  # the files in the page cache
    for _ in range(args.rounds):
        ours.append(timed(sys.executable, EDGEINFER, args.export))
        theirs.append(timed(args.genai_python, GENAI, args.genai_model))
    genai = statistics.median(t["load"] for t in theirs)
    genai_tokenizer = statistics.median(t["with_tokenizer"] for t in theirs)
    mine = statistics.median(t["load"] for t in ours)
    print(f"edgeinfer Engine.load: median {mine:.2f} s ({', '.join(f'{t:.2f}' for t in (t['load'] for t in ours))})")
    listed = ", ".join(f"{t['load']:.2f}" for t in theirs)
    print(f"genai og.Model: median {genai:.2f} s ({listed}); with og.Tokenizer {genai_tokenizer:.2f} s")
    print(f"ratio edgeinfer / genai: {mine / genai:.2f} (model only), {mine / genai_tokenizer:.2f} (with the tokenizer)")
    whole = [statistics.median(t["process"] for t in runs) for runs in (ours, theirs)]
    print(
        f"whole process (interpreter, imports, load): edgeinfer {whole[0]:.2f} s, genai {whole[1]:.2f} s, "
        f"ratio {whole[0] / whole[1]:.2f}"
    )


if __name__ == "__main__":
    main()
