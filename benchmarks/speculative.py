"""What speculative decoding gains: decode tokens/s of greedy generation with and without it, on
tasks whose output copies the input (the model fixes a ~500-token text, or answers from a
document) and on an open-ended one (a story), runs alternating, median of ROUNDS.

    python benchmarks/speculative.py EXPORT_DIR [--draft DRAFT_DIR] [--tokens N] [--rounds R]

Greedy output is the same token for token with and without on fp32 exports (the line says whether
it was; an int4 export's several-token passes round differently, see the README); the figure is the
decode rate after the first token. CPU, 2 threads, the export's chat template.
"""

import argparse
import statistics
from pathlib import Path

from edgeinfer import Engine

TEXT = (Path(__file__).resolve().parents[1] / "export" / "quality_text.txt").read_text()
PASSAGE = " ".join(TEXT.split()[:380])  # about 500 tokens
TYPOS = PASSAGE.replace(" the ", " teh ", 6).replace("morning", "mornnig", 2).replace(" and ", " adn ", 4)
STORY = "Write a long story about a robot who learns to paint."
TASKS = {  # name: (request, settings besides greedy)
    "fix typos (500-token text)": (f"Correct the spelling mistakes in this text and write it out again in full:\n\n{TYPOS}", {}),
    "answer from a document": (f"{PASSAGE}\n\nQuote the sentences of the text above that describe the sailboat.", {}),
    "open-ended story": (STORY, {}),
    "story, repetition penalty 1.3": (STORY, {"repetition_penalty": 1.3}),  # little for lookup to copy
}


def decode_rate(engine: Engine, ids: list[int], tokens: int, settings: dict) -> tuple[float, list[int], tuple]:
    result = engine.generate(ids, max_new_tokens=tokens, **settings)
    return result.decode_tokens_per_s, result.token_ids, (result.proposed_tokens, result.accepted_tokens)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("export_dir")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=5, help="num_speculative_tokens")
    args = parser.parse_args()
    engine = Engine.load(args.export_dir, provider="cpu", threads=2, prefix_cache=0, draft=args.draft)
    mode = "draft" if args.draft else "prompt_lookup"
    variants = {"plain": {}, mode: {"speculative": mode, "num_speculative_tokens": args.count}}
    print(
        f"{args.export_dir}, {mode}{' ' + args.draft if args.draft else ''}, {args.tokens} tokens, greedy, "
        f"median of {args.rounds} alternating runs"
    )
    for task, (text, extra) in TASKS.items():
        ids = engine.chat_prompt([{"role": "user", "content": text}])
        engine.generate(ids, max_new_tokens=8)  # warm-up
        rates = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, settings in variants.items():
                rate, tokens, counts = decode_rate(engine, ids, args.tokens, {**settings, **extra})
                rates[name].append(rate)
                if name == "plain":
                    expected = tokens
                else:
                    same = tokens == expected
                    first = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), min(len(tokens), len(expected)))
        plain, fast = statistics.median(rates["plain"]), statistics.median(rates[mode])
        print(
            f"{task:30s} prompt {len(ids):4d}  plain {plain:6.1f} tok/s  {mode} {fast:6.1f} tok/s  ratio {fast / plain:.2f}x  "
            f"(accepted {counts[1]} of {counts[0]} proposed; tokens {'the same' if same else f'differ from token {first}'})"
        )


if __name__ == "__main__":
    main()
