"""Decode rates of several exports of one model, alternated in one run: greedy, a short prompt,
`--new-tokens` tokens each (EOS ignored), `--rounds` rounds, medians.

    python benchmarks/decode_compare.py EXPORT [EXPORT ...] [--rounds 5] [--new-tokens 128]

Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("exports", nargs="+")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    from edgeinfer import Engine

    engines = {path: Engine.load(path, provider="cpu") for path in args.exports}
    for engine in engines.values():  # warm-up
        engine.generate("The history of Paris", max_new_tokens=16, ignore_eos=True)
    rates = {path: [] for path in engines}
    for _ in range(args.rounds):
        for path, engine in engines.items():
            result = engine.generate("The history of Paris", max_new_tokens=args.new_tokens, ignore_eos=True)
            rates[path].append(result.decode_tokens_per_s)
    for path, measured in rates.items():
        print(f"{path}: median {statistics.median(measured):.1f} tok/s ({', '.join(f'{r:.1f}' for r in measured)})")


if __name__ == "__main__":
    main()
