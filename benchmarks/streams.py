"""One stream against several: each export's decode rate alone, its TTFT on a long prompt, and the
aggregate tok/s of N concurrent streams through the Scheduler (continuous batching), the exports
alternated, `--rounds` rounds, medians. The scaling column is N streams' aggregate over one
stream's rate.

    python benchmarks/streams.py EXPORT [EXPORT ...] [--streams 8] [--rounds 5] [--new-tokens 128]

Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time


def one_round(engine, streams: int, new_tokens: int, prompt_tokens: int) -> dict:
    from edgeinfer import Scheduler

    prompt = [(7 * i) % 300 + 3 for i in range(prompt_tokens)]
    single = engine.generate(prompt[:16], max_new_tokens=new_tokens, ignore_eos=True)
    long = engine.generate(prompt, max_new_tokens=2, ignore_eos=True)
    with Scheduler(engine, max_batch=streams) as scheduler:
        start = time.perf_counter()
        requests = [scheduler.submit([5 + i] + prompt[:15], max_new_tokens=new_tokens, ignore_eos=True) for i in range(streams)]
        made = sum(len(r.result().token_ids) for r in requests)
        served = made / (time.perf_counter() - start)
    return {"decode": single.decode_tokens_per_s, "ttft_ms": long.ttft_s * 1000, "served": served}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", nargs="+")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512, help="the TTFT prompt's length")
    args = parser.parse_args()
    from edgeinfer import Engine

    engines = {path: Engine.load(path, provider="cpu", prefix_cache=0, max_batch=args.streams) for path in args.exports}
    for engine in engines.values():  # warm-up
        one_round(engine, args.streams, 8, 32)
    rounds = {path: [] for path in engines}
    for _ in range(args.rounds):
        for path, engine in engines.items():
            rounds[path].append(one_round(engine, args.streams, args.new_tokens, args.prompt_tokens))
    print(f"| export | decode tok/s, 1 stream | TTFT ms at {args.prompt_tokens} tokens | {args.streams} streams, tok/s | scaling |")
    print("|---|---:|---:|---:|---:|")
    for path, measured in rounds.items():
        decode, ttft, served = (statistics.median(r[key] for r in measured) for key in ("decode", "ttft_ms", "served"))
        print(f"| {path} | {decode:.1f} | {ttft:.0f} | {served:.1f} | {served / decode:.2f}x |")


if __name__ == "__main__":
    main()
