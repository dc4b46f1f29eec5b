"""What the generation features cost: sampling against greedy, and batches against single prompts.

    python benchmarks/generation.py EXPORT_DIR [PROMPTS_JSON]

The 128-token prompt of PROMPTS_JSON (default benchmarks/prompts.json: SmolLM2's token ids of the peers'
prompt text), CPU, 2 threads,
64 new tokens (ignore_eos), median of 3 with the variants alternating in each round.
"""
import json
import statistics
import sys
import time
from pathlib import Path

from edgeinfer import Engine

NEW_TOKENS, ROUNDS = 64, 3
VARIANTS = {
    "greedy": {},
    "top-k 50, temperature 0.7": {"top_k": 50, "temperature": 0.7, "seed": 0},
    "top-p 0.9, temperature 0.7": {"top_p": 0.9, "temperature": 0.7, "seed": 0},
    "top-p 0.9 + repetition penalty 1.1": {"top_p": 0.9, "temperature": 0.7, "repetition_penalty": 1.1, "seed": 0},
}
BATCHES = (1, 2, 4)


def main(export_dir: str, prompts_path: str) -> None:
    ids = json.loads(Path(prompts_path).read_text())["prompts"]["p128"]
    engine = Engine.load(export_dir, provider="cpu", threads=2)
    engine.generate(ids, max_new_tokens=4)  # warm-up
    rates = {name: [] for name in VARIANTS}
    throughput = {size: [] for size in BATCHES}
    for _ in range(ROUNDS):
        for name, settings in VARIANTS.items():
            rates[name].append(engine.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True, **settings).decode_tokens_per_s)
        for size in BATCHES:
            start = time.perf_counter()
            engine.generate_batch([ids] * size, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            throughput[size].append(size * NEW_TOKENS / (time.perf_counter() - start))
    greedy = statistics.median(rates["greedy"])
    for name, values in rates.items():
        print(f"{name:36s} decode {statistics.median(values):5.1f} tok/s ({statistics.median(values) / greedy:.2f}x greedy)")
    single = statistics.median(throughput[1])
    for size, values in throughput.items():
        print(f"batch {size}: {statistics.median(values):6.1f} tok/s in all, prefill included ({statistics.median(values) / single:.2f}x batch 1)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else str(Path(__file__).resolve().with_name("prompts.json")))
