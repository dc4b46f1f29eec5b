"""What the prefix cache saves: a 1,000-token system prompt followed by 5 different 20-token
questions, each asked once, with the cache on and off (two engines on the same export, asked in
turn). Prints each question's time to first token, and the later questions' median against the
first one's.

    python benchmarks/prefix_cache.py EXPORT_DIR [PROMPTS_JSON]

The token ids come from PROMPTS_JSON (default benchmarks/prompts.json: SmolLM2's tokenization of
the peers' text), so use a SmolLM2 export. CPU, 2 threads, greedy, 1 new token.
"""

import json
import statistics
import sys
from pathlib import Path

from edgeinfer import Engine


def main(export_dir: str, prompts_path: str) -> None:
    text = json.loads(Path(prompts_path).read_text())["prompts"]["p1024"]
    system, questions = text[:1000], [text[100 + 40 * i : 120 + 40 * i] for i in range(5)]  # 20 tokens of the text each
    for name, budget in (("cache on", 128), ("cache off", 0)):
        engine = Engine.load(export_dir, provider="cpu", threads=2, prefix_cache=budget)
        engine.generate(text[1000:0:-1], max_new_tokens=1)  # warm-up: as long, no block in common
        ttft = [engine.generate(system + q, max_new_tokens=1).ttft_s for q in questions]
        later = statistics.median(ttft[1:])
        print(
            f"{name:9s} TTFT ms: "
            + " ".join(f"{1000 * t:6.0f}" for t in ttft)
            + f"   later / first: {later / ttft[0]:.3f}   (hits {engine.prefix_cache.hit_tokens}, held "
            f"{engine.prefix_cache.num_bytes / 2**20:.1f} MiB)"
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else str(Path(__file__).resolve().with_name("prompts.json")))
