"""Two commits served and calling tools, alternated in one run: each round starts a server of the old
commit, then of the new one (`--prefix-cache 0`), and drives each with benchmarks/serve.py's
streaming clients (1 and 4 clients, --seconds each, a 128-token prompt, 64 tokens); then runs
benchmarks/tools.py (a forced call's decode rate against plain greedy decoding) with each commit's
SDK. Prints every round's figures and the medians of the rounds.

    python benchmarks/compare_served.py EXPORT_DIR OLD_COMMIT [NEW_COMMIT] [--rounds 3] [--seconds 10]

Each commit is imported from a worktree (compare_trees.package_of), in processes of its own.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from compare_trees import in_tree, server_of, trees  # noqa: E402
from serve import PROMPTS, level, one_request  # noqa: E402

CLIENTS = (1, 4)


def served(package: Path, export: str, seconds: float) -> dict:
    """Aggregate tok/s and TTFT p50 at each number of clients, against a server of `package`."""
    with server_of(package, export, "--prefix-cache", "0") as url:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        ids = json.loads(PROMPTS.read_text())["prompts"]["p128"]
        body = {"model": model, "prompt": ids, "max_tokens": 64, "temperature": 0, "stream": True, "ignore_eos": True}
        body["stream_options"] = {"include_usage": True}
        one_request(httpx.Client(timeout=300), f"{url}/v1", {**body, "max_tokens": 4})  # warm-up
        figures = {}
        for clients in CLIENTS:
            found = level(f"{url}/v1", body, clients, seconds)
            figures[f"{clients}c tok/s"] = found["aggregate_tokens_per_s"]
            figures[f"{clients}c TTFT ms"] = found["ttft_p50_ms"]
        return figures


def tool_cost(package: Path, export: str) -> dict:
    """benchmarks/tools.py's medians with `package`'s SDK (3 rounds)."""
    done = subprocess.run(
        [sys.executable, str(HERE / "tools.py"), export, "--rounds", "3"],
        **in_tree(package),
        check=True,
        capture_output=True,
        text=True,
    )
    plain = float(re.search(r"plain greedy: median ([\d.]+)", done.stdout).group(1))
    forced = float(re.search(r"forced call:  median ([\d.]+)", done.stdout).group(1))
    return {"plain tok/s": plain, "forced call tok/s": forced, "forced/plain": forced / plain}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export")
    parser.add_argument("old")
    parser.add_argument("new", nargs="?", default="HEAD")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10)
    args = parser.parse_args()
    export = str(Path(args.export).resolve())
    runs = {"old": [], "new": []}
    with trees(args.old, args.new) as packages:
        for round_ in range(args.rounds):
            for name, package in zip(runs, packages):
                runs[name].append({**served(package, export, args.seconds), **tool_cost(package, export)})
                print(f"round {round_ + 1} {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in runs[name][-1].items()), flush=True)
    for name, commit in (("old", args.old), ("new", args.new)):
        medians = {k: statistics.median(run[k] for run in runs[name]) for k in runs[name][0]}
        print(f"{name} {commit} medians: " + ", ".join(f"{k} {v:.3g}" for k, v in medians.items()))


if __name__ == "__main__":
    main()
