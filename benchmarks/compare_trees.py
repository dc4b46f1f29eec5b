"""Two commits of edgeinfer on one export, alternated in one run: decode rate and TTFT of one request
alone (a 200-token prompt, 200 new tokens, median of 5), and the total rate of 8 requests of 150
tokens through the Scheduler. Each round runs the old commit, then the new one, each in a process of
its own; the medians of the rounds are printed.

    python benchmarks/compare_trees.py EXPORT_DIR OLD_COMMIT [NEW_COMMIT] [--rounds 3]

Each commit is checked out into a worktree under a temporary folder and imported from there (the
package's folders mapped as pyproject.toml maps them), with this environment's packages.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("sdk", "export", "cli", "models", "serve")

ONE_RUN = r"""
import json, statistics, sys, time
from edgeinfer import Engine, Scheduler

engine = Engine.load(sys.argv[1], provider="cpu", prefix_cache=0, max_batch=8)
prompt = [(7 * i) % 300 + 3 for i in range(200)]
engine.generate(prompt[:16], max_new_tokens=8)
runs = [engine.generate(prompt, max_new_tokens=200, ignore_eos=True) for _ in range(5)]
with Scheduler(engine, max_batch=8) as scheduler:
    start = time.perf_counter()
    requests = [scheduler.submit([5 + i] + prompt[:50], max_new_tokens=150, ignore_eos=True) for i in range(8)]
    made = sum(len(r.result().token_ids) for r in requests)
    served = made / (time.perf_counter() - start)
print(json.dumps({"decode_tok_s": statistics.median(r.decode_tokens_per_s for r in runs),
                  "ttft_ms": statistics.median(r.ttft_s for r in runs) * 1000, "served_tok_s": served}))
"""


def package_of(commit: str, folder: Path) -> Path:
    """A folder to put on PYTHONPATH that imports `edgeinfer` from `commit`."""
    tree = folder / f"tree-{commit}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit], check=True, capture_output=True)
    package = folder / f"pkg-{commit}" / "edgeinfer"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text((tree / "edgeinfer" / "__init__.py").read_text())
    for part in PARTS:
        (package / part).symlink_to(tree / part)
    found = subprocess.run(
        [sys.executable, "-c", "import edgeinfer.serve.app as a, os; print(os.path.realpath(a.__file__))"],
        **in_tree(package.parent),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not found.startswith(str(tree.resolve())):
        raise SystemExit(f"edgeinfer of {commit} imports from {found}, not from its worktree {tree}")
    return package.parent


def in_tree(path: Path) -> dict:
    """The environment and folder of a process that imports `edgeinfer` from `path` (package_of):
    started in the repository's root, `python -c` and `python -m` would import the root's own
    package first (the current folder leads sys.path), whatever PYTHONPATH says."""
    return {"env": {**os.environ, "PYTHONPATH": str(path)}, "cwd": str(path)}


@contextlib.contextmanager
def trees(*commits: str):
    """A package folder (package_of) per commit, each from a worktree of its own (the same commit
    twice is two), in a temporary folder; afterwards the folder goes and git forgets the worktrees."""
    try:
        with tempfile.TemporaryDirectory() as temporary:
            yield [package_of(commit, Path(temporary) / str(i)) for i, commit in enumerate(commits)]
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)


@contextlib.contextmanager
def server_of(package: Path, export: str, *flags: str):
    """The URL of an `edgeinfer serve` of `package` on `export` (CPU, a free port of 127.0.0.1),
    once /health says 200; the server is stopped after."""
    import httpx  # the serve extra's

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "edgeinfer.cli", "serve", "--model", str(Path(export).resolve()), "--port", str(port)]
    process = subprocess.Popen(
        [*command, "--provider", "cpu", *flags], **in_tree(package), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)


def one_run(path: Path, export: str) -> dict:
    export = str(Path(export).resolve())
    done = subprocess.run([sys.executable, "-c", ONE_RUN, export], **in_tree(path), check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export")
    parser.add_argument("old")
    parser.add_argument("new", nargs="?", default="HEAD")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with trees(args.old, args.new) as packages:
        figures = {"old": [], "new": []}
        for round_ in range(args.rounds):
            for name, path in zip(figures, packages):
                figures[name].append(one_run(path, args.export))
                print(f"round {round_ + 1} {name}: {json.dumps(figures[name][-1])}", flush=True)
    for name, runs in figures.items():
        medians = {key: round(statistics.median(run[key] for run in runs), 1) for key in runs[0]}
        ranges = {key: (round(min(run[key] for run in runs), 1), round(max(run[key] for run in runs), 1)) for key in runs[0]}
        print(f"{name} ({args.old if name == 'old' else args.new}): medians {medians}, ranges {ranges}")


if __name__ == "__main__":
    main()
