"""Choosing the next token from one row's last-position logits: a Sampler built once from the
settings (greedy when temperature is 0, else a short chain of filters, then a seeded draw).

The order is transformers' (repetition penalty, temperature, top-k, top-p, min-p), with OpenAI's
presence and frequency penalties and the logit bias after the repetition penalty, and a
constraint's mask (constraints.py) before the temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .settings import GenerationConfig


@dataclass
class TokenLogprob:
    """A chosen token's log-probability and the `top` most likely tokens with theirs, most likely
    first, all under the distribution the token was drawn from (see `Sampler.choose`)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]

    @classmethod
    def of(cls, token: int, logprobs: np.ndarray, top: int) -> TokenLogprob:
        best = np.argpartition(-logprobs, top - 1)[:top] if 0 < top < logprobs.size else np.arange(logprobs.size if top else 0)
        best = best[np.argsort(-logprobs[best], kind="stable")]
        return cls(int(token), float(logprobs[token]), [(int(t), float(logprobs[t])) for t in best if logprobs[t] > -np.inf])


class Sampler:
    """One row's choice of the next token from its last-position logits, built once from the
    settings and owning its seeded random generator (equal seeds give equal draws in any process).

    `adjust` applies the penalties and the bias; the caller may then mask tokens out (-inf, a
    constraint); `choose` picks greedily (temperature 0 or top_k 1) or draws through temperature,
    top-k, top-p and min-p."""

    def __init__(self, config: GenerationConfig):
        self.config = config
        self.is_greedy = config.temperature == 0 or config.top_k == 1
        self.rng = None if self.is_greedy else np.random.default_rng(config.seed)
        self.bias_ids = np.array([t for t, _ in config.logit_bias], np.int64)
        self.bias = np.array([b for _, b in config.logit_bias], np.float32)

    def adjust(self, logits: np.ndarray, history: Sequence[int], generated: Sequence[int]) -> np.ndarray:
        """The logits after the repetition penalty (on `history`, the prompt included), OpenAI's
        presence and frequency penalties (on the `generated` tokens) and the logit bias."""
        config = self.config
        scores = penalize(logits, history, config.repetition_penalty)
        scores = presence_frequency(scores, generated, config.presence_penalty, config.frequency_penalty)
        if self.bias.size:
            scores = scores.copy() if scores is logits else scores
            scores[self.bias_ids] += self.bias
        return scores

    def choose(self, scores: np.ndarray, want_logprobs: bool = False, proposal: int | None = None) -> tuple[int, np.ndarray | None]:
        """The next token and, if asked, the log-probabilities [vocab] it was chosen under: for a
        greedy pick, log-softmax of `scores`; for a draw, the distribution drawn from (temperature
        applied, the tokens the filters dropped at -inf).

        With a `proposal` (speculative decoding's drafted token), a draw keeps it with its
        probability p under that distribution and otherwise draws from the distribution without it:
        the rejection rule for a proposer that puts all its mass on one token, which leaves the
        distribution of the chosen token exactly p. A greedy pick ignores the proposal (the caller
        compares)."""
        if self.is_greedy:
            token = int(np.argmax(scores))
            return token, log_softmax(scores) if want_logprobs else None
        ids, weights = self.distribution(scores)
        token = self._draw(ids, weights, proposal)
        if not want_logprobs:
            return token, None
        logprobs = np.full(scores.size, -np.inf)
        with np.errstate(divide="ignore"):
            logprobs[ids] = np.log(weights / weights.sum())
        return token, logprobs

    def distribution(self, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tokens a draw can pick and their weights (unnormalized probabilities): temperature,
        top-k, then top-p and min-p."""
        config = self.config
        scores = scores.astype(np.float64)
        with np.errstate(over="ignore"):  # at most 0: a tiny temperature gives -inf, never inf - inf = nan
            scores = (scores - scores.max()) / config.temperature
        ids = top_k(scores, config.top_k)
        probs = softmax(scores[ids])
        return ids, np.where(top_p(probs, config.top_p) & min_p(probs, config.min_p), probs, 0.0)

    def _draw(self, ids: np.ndarray, weights: np.ndarray, proposal: int | None) -> int:
        if proposal is not None:
            where = np.flatnonzero(ids == proposal)
            kept = float(weights[where[0]]) / weights.sum() if where.size else 0.0
            if self.rng.random() < kept:
                return proposal
            if where.size:  # rejected: draw from the rest
                weights = weights.copy()
                weights[where[0]] = 0.0
        return int(ids[draw(weights, self.rng)])


def log_softmax(scores: np.ndarray) -> np.ndarray:
    scores = scores.astype(np.float64)
    shifted = scores - scores.max()
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.exp(shifted).sum())


def presence_frequency(logits: np.ndarray, generated: Sequence[int], presence: float, frequency: float) -> np.ndarray:
    """OpenAI's penalties: `presence` is subtracted once from the logit of every token generated so
    far, and `frequency` once per time it was generated."""
    if (presence == 0 and frequency == 0) or len(generated) == 0:
        return logits
    ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
    out = logits.copy()
    out[ids] -= (presence + frequency * counts).astype(out.dtype)
    return out


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
