"""What the generation features cost: sampling and a JSON-schema constraint against greedy, and
batches against single prompts.

    python benchmarks/generation.py EXPORT_DIR [PROMPTS_JSON]

The 128-token prompt of PROMPTS_JSON (default benchmarks/prompts.json: SmolLM2's token ids of the peers'
prompt text), CPU, 2 threads,
64 new tokens (ignore_eos), median of 3 with the variants alternating in each round. The constrained
variant cannot ignore the EOS; its schema (a list of at least 40 strings) keeps it going past 64 tokens.
The mask's cost per token is the time llguidance takes to compute it, plus applying it.
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
# A constrained output that cannot end within NEW_TOKENS: the run ends on max_new_tokens, as the others do.
LONG_LIST = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 40}},
    "required": ["items"],
}
CONSTRAINED = {
    "greedy, JSON schema": {"response_format": {"type": "json_schema", "json_schema": {"schema": LONG_LIST}}},
    "greedy, logprobs (top 5)": {"logprobs": True, "top_logprobs": 5},
}
BATCHES = (1, 2, 4)


class MaskClock:
    """Time spent computing and applying constraint masks (Matcher.mask), and how many."""

    def __init__(self):
        from edgeinfer.sdk.constraints import Matcher

        self.seconds, self.count, original = 0.0, 0, Matcher.mask

        def timed(matcher, scores):
            start = time.perf_counter()
            try:
                return original(matcher, scores)
            finally:
                self.seconds += time.perf_counter() - start
                self.count += 1

        Matcher.mask = timed


def main(export_dir: str, prompts_path: str) -> None:
    ids = json.loads(Path(prompts_path).read_text())["prompts"]["p128"]
    engine = Engine.load(export_dir, provider="cpu", threads=2, prefix_cache=0)  # every run prefills its prompt
    engine.generate(ids, max_new_tokens=4)  # warm-up
    rates = {name: [] for name in [*VARIANTS, *CONSTRAINED]}
    throughput = {size: [] for size in BATCHES}
    clock = MaskClock()
    for _ in range(ROUNDS):
        for name, settings in VARIANTS.items():
            rates[name].append(engine.generate(ids, max_new_tokens=NEW_TOKENS, ignore_eos=True, **settings).decode_tokens_per_s)
        for name, settings in CONSTRAINED.items():
            result = engine.generate(ids, max_new_tokens=NEW_TOKENS, **settings)
            assert result.finish_reason == "length", result
            rates[name].append(result.decode_tokens_per_s)
        for size in BATCHES:
            start = time.perf_counter()
            engine.generate_batch([ids] * size, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            throughput[size].append(size * NEW_TOKENS / (time.perf_counter() - start))
    greedy = statistics.median(rates["greedy"])
    for name, values in rates.items():
        print(f"{name:36s} decode {statistics.median(values):5.1f} tok/s ({statistics.median(values) / greedy:.2f}x greedy)")
    print(f"constraint mask: {1000 * clock.seconds / max(clock.count, 1):.3f} ms per token over {clock.count} tokens")
    single = statistics.median(throughput[1])
    for size, values in throughput.items():
        print(
            f"batch {size}: {statistics.median(values):6.1f} tok/s in all, prefill included ({statistics.median(values) / single:.2f}x batch 1)"
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else str(Path(__file__).resolve().with_name("prompts.json")))
