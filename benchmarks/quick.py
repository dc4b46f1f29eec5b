"""Quick single-engine figures for an export: TTFT and decode rate per prompt length, peak RSS.

    python benchmarks/quick.py EXPORT_DIR [PROMPTS_JSON]

PROMPTS_JSON defaults to ../shared/peers/prompts.json (the peers' token ids, so the figures line up
with ../shared/peers/RESULTS.md). Greedy, 2 threads, CPU, exactly 128 new tokens, median of 3.
"""
import json
import resource
import statistics
import sys
import time
from pathlib import Path

from edgeinfer import Engine

NEW_TOKENS, REPEATS = 128, 3


def main(export_dir: str, prompts_path: str) -> None:
    prompts = json.loads(Path(prompts_path).read_text())["prompts"]
    start = time.perf_counter()
    engine = Engine.load(export_dir, provider="cpu", threads=2)
    print(f"load {time.perf_counter() - start:.2f} s, peak RSS after load {peak_rss_mib():.0f} MiB")
    engine.generate(prompts["p16"], max_new_tokens=8)  # warm-up
    for name, ids in prompts.items():
        # ignore_eos: every run makes exactly NEW_TOKENS tokens, as the peers do
        runs = [engine.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True) for _ in range(REPEATS)]
        assert all(len(r.token_ids) == NEW_TOKENS for r in runs)
        ttft = statistics.median(r.ttft_s for r in runs) * 1000
        rate = statistics.median(r.decode_tokens_per_s for r in runs)
        print(f"{name:6s} ({len(ids):4d} tokens): TTFT {ttft:7.0f} ms, decode {rate:5.1f} tok/s")
    print(f"peak RSS {peak_rss_mib():.0f} MiB")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else str(here.parent.parent / "shared" / "peers" / "prompts.json"))
