"""edgeinfer, onnxruntime-genai and llama.cpp on one model at the sizes people run (1-8B), alternated:
each engine once a round, in its own process, on the same machine and threads (2), the same prompt
lengths, greedy, 128 new tokens, each cell the median of 3 runs and then of the rounds.

    python benchmarks/peers_at_size.py --export EXPORT [--export EXPORT2] [--kernel-off]
        [--genai GENAI_MODEL --genai-python GENAI_VENV/bin/python]
        [--gguf Q4_0.gguf Q4_K_M.gguf --llama-bin DIR] [--lengths 128,512,1024] [--rounds 3]

The exports are edgeinfer's (`edgeinfer export ... --quantize int4`); `--kernel-off` runs the first
again with EDGEINFER_CPU_KERNEL=0 (ONNX Runtime's MatMulNBits, as exported), to set edgeinfer's
own CPU kernel against the kernel the other ONNX Runtime engine uses. genai's model is made by
its builder (`python -m onnxruntime_genai.models.builder -i HF -o OUT -p int4 -e cpu`) and timed by
benchmarks/genai_bench.py in genai's environment; llama.cpp by `llama-bench` (benchmarks/peers.py's
`run_llama`). Prompts are the first `--lengths` of benchmarks/prompts.json's token ids (edgeinfer and
genai) and llama-bench's own tokens of those lengths.

Prints a Markdown table: decode tok/s after each length, TTFT at each length, and the first engine's
decode over each other engine's. Figures, never asserted."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from peers import HERE, run_edgeinfer, run_llama, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--export", type=Path, action="append", required=True)
    parser.add_argument("--kernel-off", action="store_true", help="the first export again on MatMulNBits")
    parser.add_argument("--genai", type=Path)
    parser.add_argument("--genai-python", type=Path)
    parser.add_argument("--gguf", type=Path, nargs="*", default=[])
    parser.add_argument("--llama-bin", type=Path)
    parser.add_argument("--lengths", default="128,512,1024")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if bool(args.genai) != bool(args.genai_python) or bool(args.gguf) != bool(args.llama_bin):
        parser.error("--genai goes with --genai-python, --gguf with --llama-bin")
    with tempfile.TemporaryDirectory() as scratch:
        prompts = subset(Path(scratch), [int(n) for n in args.lengths.split(",")])
        engines = plan(args, prompts, Path(scratch))
        runs = {name: [] for name in engines}
        for round_ in range(args.rounds):
            step(f"round {round_ + 1} of {args.rounds}")
            for name, run in engines.items():
                runs[name].append(run())
    print(table(runs, args))


def subset(folder: Path, lengths: list[int]) -> Path:
    """prompts.json with the prompts of `lengths` tokens only."""
    every = json.loads((HERE / "prompts.json").read_text())
    chosen = {name: ids for name, ids in every["prompts"].items() if len(ids) in lengths}
    missing = set(lengths) - {len(ids) for ids in chosen.values()}
    if missing:
        raise SystemExit(f"benchmarks/prompts.json has no prompt of {sorted(missing)} tokens")
    path = folder / "prompts.json"
    path.write_text(json.dumps({**every, "prompts": chosen}))
    return path


def plan(args, prompts: Path, scratch: Path) -> dict:
    """Each engine's name and the call that times it once."""
    engines = {}
    for i, export in enumerate(args.export):
        engines[f"edgeinfer {export.name}"] = lambda e=export, i=i: run_edgeinfer(e, scratch / f"e{i}.json", prompts)
    if args.kernel_off:
        off = {**os.environ, "EDGEINFER_CPU_KERNEL": "0"}
        first = args.export[0]
        engines[f"edgeinfer {first.name}, MatMulNBits"] = lambda: run_edgeinfer(first, scratch / "off.json", prompts, off)
    if args.genai:
        engines[f"genai {args.genai.name}"] = lambda: run_genai(args.genai_python, args.genai, scratch / "genai.json", prompts)
    for gguf in args.gguf:
        engines[f"llama.cpp {gguf.name}"] = lambda g=gguf: run_llama(args.llama_bin, g, prompts)
    return engines


def run_genai(python: Path, model: Path, out: Path, prompts: Path) -> dict:
    step(f"onnxruntime-genai: {model.name}")
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    subprocess.run([str(python), str(HERE / "genai_bench.py"), str(model), str(out), "--prompts", str(prompts)], check=True, env=env)
    return json.loads(out.read_text())


def table(runs: dict[str, list[dict]], args) -> str:
    names = list(runs)
    prompts = list(runs[names[0]][0]["prompts"])

    def median(name, prompt, key):
        return statistics.median(run["prompts"][prompt][key] for run in runs[name])

    header = " | ".join(f"decode after {p} tok/s" for p in prompts) + " | " + " | ".join(f"TTFT {p} ms" for p in prompts)
    lines = [
        f"rounds: {args.rounds}; in parentheses, the first engine's decode over this engine's",
        "",
        f"| engine | {header} |",
        "|---|" + "---:|" * (2 * len(prompts)),
    ]
    for name in names:
        decode = []
        for p in prompts:
            rate, first = median(name, p, "decode_tps"), median(names[0], p, "decode_tps")
            decode.append(f"{rate:.1f}" + ("" if name == names[0] else f" ({first / rate:.2f})"))
        ttft = [f"{median(name, p, 'ttft_ms'):.0f}" for p in prompts]
        lines.append(f"| {name} | " + " | ".join(decode + ttft) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
