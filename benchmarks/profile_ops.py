"""Where a decode step's time goes, by op type, from an ONNX Runtime profile written under
EDGEINFER_PROFILE: the node times of every run after the first (the prefill), summed per op type
and divided by the runs, beside a run's whole time (the rest is ONNX Runtime's own per-node work).

    EDGEINFER_PROFILE=/tmp/p/run edgeinfer run --model DIR --max-context 8192 --max-new-tokens 48 --ignore-eos "Hello"
    python benchmarks/profile_ops.py /tmp/p [--top 12]

Takes the newest profile in each folder given."""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def decode_ops(profile: Path) -> tuple[int, float, float, collections.Counter]:
    """(decode runs, ms a run, node ms a run, node microseconds by op type over all decode runs)."""
    events = json.loads(profile.read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    if len(runs) < 2:
        raise SystemExit(f"{profile} holds {len(runs)} graph runs: a prefill and at least one decode step are needed")
    prefill_end = runs[0]["ts"] + runs[0]["dur"]
    by_op = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time") and event["ts"] > prefill_end:
            by_op[event["args"].get("op_name", "?")] += event["dur"]
    decode = len(runs) - 1
    return decode, sum(r["dur"] for r in runs[1:]) / decode / 1000, sum(by_op.values()) / decode / 1000, by_op


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    for folder in args.folders:
        profiles = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime)
        if not profiles:
            raise SystemExit(f"{folder} holds no profile: run with EDGEINFER_PROFILE={folder}/run first")
        runs, run_ms, node_ms, by_op = decode_ops(profiles[-1])
        print(f"{folder}: {runs} decode runs, {run_ms:.1f} ms a run, {node_ms:.1f} ms of it in nodes")
        for op, micros in by_op.most_common(args.top):
            print(f"  {op:34s} {micros / runs / 1000:7.2f} ms")


if __name__ == "__main__":
    main()
