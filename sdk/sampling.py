"""Choosing the next token from one row's last-position logits: a pure function built once from
the settings (greedy when temperature is 0, else a short chain of filters, then a seeded draw).

The order of the filters is transformers': repetition penalty, temperature, top-k, top-p, min-p.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .settings import GenerationConfig

Sampler = Callable[[np.ndarray, Sequence[int]], int]


def make_sampler(config: GenerationConfig) -> Sampler:
    """A function (logits [vocab], token history) → next token id. Each sampler owns its random
    generator, seeded from `config.seed`, so equal seeds give equal draws in any process."""
    penalty = config.repetition_penalty
    if config.temperature == 0 or config.top_k == 1:
        return lambda logits, history: int(np.argmax(penalize(logits, history, penalty)))
    rng = np.random.default_rng(config.seed)

    def sample(logits: np.ndarray, history: Sequence[int]) -> int:
        scores = penalize(logits, history, penalty).astype(np.float64)
        with np.errstate(over="ignore"):  # at most 0: a tiny temperature gives -inf, never inf - inf = nan
            scores = (scores - scores.max()) / config.temperature
        ids = top_k(scores, config.top_k)
        probs = softmax(scores[ids])
        keep = top_p(probs, config.top_p) & min_p(probs, config.min_p)
        return int(ids[draw(np.where(keep, probs, 0.0), rng)])

    return sample


def penalize(logits: np.ndarray, history: Sequence[int], penalty: float) -> np.ndarray:
    """Make tokens already seen (prompt included) less likely: positive logits are divided by
    `penalty`, negative ones multiplied."""
    if penalty == 1.0 or len(history) == 0:
        return logits
    seen = np.unique(np.asarray(history, dtype=np.int64))
    out = logits.copy()
    out[seen] = np.where(out[seen] < 0, out[seen] * penalty, out[seen] / penalty)
    return out


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Ids of the `k` largest scores (all ids when k is 0 or at least the vocabulary)."""
    if 0 < k < scores.size:
        return np.argpartition(-scores, k - 1)[:k]
    return np.arange(scores.size)


def softmax(scores: np.ndarray) -> np.ndarray:
    e = np.exp(scores - scores.max())
    return e / e.sum()


def top_p(probs: np.ndarray, p: float) -> np.ndarray:
    """Keep the most likely tokens until their probabilities add up to `p` (always at least one)."""
    keep = np.zeros(probs.size, bool)
    if p >= 1.0:
        return ~keep
    ranked = _most_likely_first(probs, p)
    before = np.cumsum(probs[ranked]) - probs[ranked]  # probability mass ranked above each token
    keep[ranked[before < p]] = True
    return keep


def _most_likely_first(probs: np.ndarray, mass: float) -> np.ndarray:
    """Ids of the most likely tokens, most likely first, enough of them to hold `mass`. The mass
    usually sits in a few tokens, so a few are ranked first and the whole vocabulary only if needed
    (a full sort of a 50k vocabulary costs more than a decode step's tenth)."""
    count = min(64, probs.size)
    while True:
        ids = np.argpartition(-probs, count - 1)[:count] if count < probs.size else np.arange(probs.size)
        ids = ids[np.argsort(-probs[ids], kind="stable")]
        if count == probs.size or probs[ids].sum() >= mass:
            return ids
        count = min(count * 8, probs.size)


def min_p(probs: np.ndarray, p: float) -> np.ndarray:
    """Keep tokens at least `p` times as likely as the most likely one."""
    return probs >= p * probs.max()


def draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """An index drawn with probability proportional to `weights`."""
    cumulative = np.cumsum(weights)
    return min(int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")), weights.size - 1)
