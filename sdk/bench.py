"""Measuring an engine: load time, time to first token and decode rate per prompt length, memory.

The method matches the peers' benchmarks (benchmarks/peers.py, the engines edgeinfer is compared with): greedy, exactly
`new_tokens` tokens (EOS ignored), one warm-up run, the median of `repeats` runs per prompt.
TTFT is from the call to the first token; the decode rate leaves the first token out.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .engine import Engine
from .settings import GenerationConfig

PROMPT_LENGTHS = (16, 128, 512, 1024)


@dataclass
class PromptFigures:
    prompt_tokens: int
    ttft_ms: float
    decode_tokens_per_s: float
    runs_ttft_ms: list[float]
    runs_decode_tokens_per_s: list[float]


@dataclass
class BenchResult:
    model: str
    provider: str
    threads: int | None
    new_tokens: int
    repeats: int
    load_s: float
    rss_after_load_mib: float
    peak_rss_mib: float = 0.0
    prompts: dict[str, PromptFigures] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def run_benchmark(
    path,
    provider: str = "cpu",
    threads: int | None = None,
    prompts: dict[str, list[int]] | None = None,
    new_tokens: int = 128,
    repeats: int = 3,
    say=lambda message: None,
) -> BenchResult:
    """Load the export at `path` and measure it on `prompts` (name → token ids; default: seeded
    random ids of PROMPT_LENGTHS tokens, those that fit the model's context)."""
    start = time.perf_counter()
    engine = Engine.load(path, provider=provider, threads=threads, prefix_cache=0)  # each repeat prefills its prompt
    result = BenchResult(
        model=engine.manifest.source,
        provider=engine.provider,
        threads=threads,
        new_tokens=new_tokens,
        repeats=repeats,
        load_s=time.perf_counter() - start,
        rss_after_load_mib=rss_mib(),
    )
    prompts = prompts or random_prompts(engine, new_tokens)
    config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(next(iter(prompts.values()))[:16], config)  # warm-up
    for name, ids in prompts.items():
        runs = [engine.generate(ids, config) for _ in range(repeats)]
        ttft = [r.ttft_s * 1000 for r in runs]
        rates = [r.decode_tokens_per_s for r in runs]
        result.prompts[name] = PromptFigures(len(ids), statistics.median(ttft), statistics.median(rates), ttft, rates)
        say(f"{name}: TTFT {statistics.median(ttft):.0f} ms, decode {statistics.median(rates):.1f} tok/s")
    result.peak_rss_mib = peak_rss_mib()
    return result


def random_prompts(engine: Engine, new_tokens: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(0)
    fits = [n for n in PROMPT_LENGTHS if n + new_tokens <= engine.max_context]
    return {f"p{n}": rng.integers(0, engine.manifest.vocab_size, n).tolist() for n in fits}


def rss_mib() -> float:
    """Resident memory of this process now (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return 0.0


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
