"""Decode rate of exports at several context lengths, alternating between them round by round: a
hybrid (linear attention, whose state does not grow) beside a full-attention model of its size.

    python benchmarks/hybrid_decode.py EXPORT... [--contexts 128 1024] [--new-tokens 64] [--rounds 2] [--max-context 8192]

For each export and context, a prompt of that many tokens (ids 3.., a fixed pattern), then
--new-tokens greedy tokens past EOS; the rate is the engine's own decode rate (the tokens after the
first over the time after the first: prefill excluded). Prints one line per run and the median per export and context."""

from __future__ import annotations

import argparse
import statistics

from edgeinfer import Engine


def rate(engine: Engine, context: int, new_tokens: int) -> float:
    prompt = [3 + (7 * i) % 250 for i in range(context)]
    return engine.generate(prompt, max_new_tokens=new_tokens, ignore_eos=True).decode_tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exports", nargs="+")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-context", type=int, default=8192, help="the context each engine serves (its KV cache's size)")
    args = parser.parse_args()
    engines = {folder: Engine.load(folder, provider="cpu", max_context=args.max_context) for folder in args.exports}
    alternate(engines, args.contexts, args.new_tokens, args.rounds)


def alternate(engines: dict[str, Engine], contexts: list[int], new_tokens: int, rounds: int) -> None:
    """Each engine's decode rate at each context, the engines alternating within each round: a
    line per run, then the median per engine and context."""
    rates = {(name, context): [] for name in engines for context in contexts}
    for round_ in range(rounds):
        for context in contexts:
            for name, engine in engines.items():
                rates[name, context].append(rate(engine, context, new_tokens))
                print(f"round {round_ + 1} {name} context {context}: {rates[name, context][-1]:.1f} tok/s", flush=True)
    for (name, context), values in rates.items():
        print(f"{name} context {context}: median {statistics.median(values):.1f} tok/s over {len(values)} rounds")


if __name__ == "__main__":
    main()
