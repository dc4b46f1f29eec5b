"""What LoRA adapters cost at decode: an export's base graph against its adapters' graph with an
adapter on every row, at 1 row and at N rows, and N rows of N different adapters; alternated,
`--rounds` rounds, medians. Each figure is a decode rate over all rows (tok/s), from the engine's
own timings of a batch generated with `ignore_eos`.

    # N random rank-16 adapters on every projection, made with PEFT and added to a copy of EXPORT
    python benchmarks/adapters.py make EXPORT OUT [--adapters 8] [--rank 16]
    python benchmarks/adapters.py run OUT [--rows 8] [--rounds 5] [--new-tokens 128]

Figures are printed, never asserted. The adapters are random (B is not zero), so their tokens
differ from the base's; `ignore_eos` makes every row run to the same length.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make(export: Path, out: Path, count: int, rank: int) -> None:
    """A copy of `export` (weights hard-linked) with `count` random adapters a0.. added by export-adapter."""
    import torch
    from peft import LoraConfig, get_peft_model

    from edgeinfer.export import export_adapter
    from edgeinfer.export.source import load_model, manifest_source, resolve_source
    from edgeinfer.sdk.manifest import load_manifest

    shutil.copytree(export, out, copy_function=lambda s, t: os.link(s, t) if s.endswith(".data") else shutil.copy2(s, t))
    source = manifest_source(load_manifest(export).source)
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(count):
            model, _ = load_model(resolve_source(source, print), with_tokenizer=False)
            peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS, init_lora_weights=False))
            torch.manual_seed(i)
            for name, parameter in peft.named_parameters():
                if "lora_" in name:
                    parameter.data.normal_(0, 0.02)
            peft.save_pretrained(Path(scratch) / f"a{i}")
            export_adapter(Path(scratch) / f"a{i}", out, f"a{i}", say=print)


def rate(engine, rows: list[str | None], new_tokens: int) -> float:
    """Decode tok/s over all rows of one batch, one adapter (or None) per row."""
    from edgeinfer import GenerationConfig

    prompt = [(7 * i) % 300 + 3 for i in range(16)]
    configs = [GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True, adapter=a) for a in rows]
    results = engine.generate_batch([[5 + i] + prompt for i in range(len(rows))], configs)
    return statistics.median(r.decode_tokens_per_s for r in results) * len(rows)


def run(folder: Path, rows: int, rounds: int, new_tokens: int) -> None:
    from edgeinfer import Engine

    base = Engine.load(folder, provider="cpu", prefix_cache=0, max_batch=rows)  # never asked for an adapter: its base graph
    adapted = Engine.load(folder, provider="cpu", prefix_cache=0, max_batch=rows)
    names = sorted(adapted.manifest.adapters)
    cases = {
        "base graph, 1 row": (base, [None]),
        "one adapter, 1 row": (adapted, [names[0]]),
        f"base graph, {rows} rows": (base, [None] * rows),
        f"one adapter on {rows} rows": (adapted, [names[0]] * rows),
        f"{rows} rows of {min(rows, len(names))} adapters": (adapted, [names[i % len(names)] for i in range(rows)]),
        f"adapters' graph, {rows} base rows": (adapted, [None] * rows),
    }
    for engine, adapters in cases.values():  # warm-up (and the adapters' graph loaded)
        rate(engine, adapters, 8)
    measured = {case: [] for case in cases}
    for _ in range(rounds):
        for case, (engine, adapters) in cases.items():
            measured[case].append(rate(engine, adapters, new_tokens))
    ranks = sorted({adapted.manifest.adapters[n]["rank"] for n in names})
    print(f"{folder}: {len(names)} adapters of rank {ranks}, {new_tokens} new tokens, {rounds} rounds, medians")
    print("| case | decode tok/s (all rows) | against the base graph |")
    print("|---|---:|---:|")
    for case, figures in measured.items():
        reference = statistics.median(measured["base graph, 1 row" if case.endswith("1 row") else f"base graph, {rows} rows"])
        value = statistics.median(figures)
        print(f"| {case} | {value:.1f} | {value / reference:.1%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    making = commands.add_parser("make")
    making.add_argument("export", type=Path)
    making.add_argument("out", type=Path)
    making.add_argument("--adapters", type=int, default=8)
    making.add_argument("--rank", type=int, default=16)
    running = commands.add_parser("run")
    running.add_argument("folder", type=Path)
    running.add_argument("--rows", type=int, default=8)
    running.add_argument("--rounds", type=int, default=5)
    running.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    if args.command == "make":
        make(args.export, args.out, args.adapters, args.rank)
    else:
        run(args.folder, args.rows, args.rounds, args.new_tokens)


if __name__ == "__main__":
    main()
