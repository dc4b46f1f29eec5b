"""The sampler on hand-made logits, and its filters against transformers' own logits processors."""

import dataclasses

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from edgeinfer import GenerationConfig
from edgeinfer.sdk import sampling

LOGITS = np.random.default_rng(0).normal(0, 3, 1000).astype(np.float32)


def pick(sampler, logits, history=()) -> int:
    """The sampler's next token, as a Sequence asks for it (no constraint, no logprobs)."""
    return sampler.choose(sampler.adjust(logits, history, ()))[0]


def draws(config, n=50, logits=LOGITS):
    sampler = sampling.Sampler(config)
    return [pick(sampler, logits) for _ in range(n)]


def test_greedy_picks_the_largest_logit_whatever_the_seed():
    best = int(np.argmax(LOGITS))
    assert draws(GenerationConfig(), 5) == [best] * 5
    assert draws(GenerationConfig(seed=9), 5) == [best] * 5


@pytest.mark.parametrize("k", [2, 5, 40])
def test_top_k_sampling_at_temperature_1_draws_like_transformers_warper(k):
    """The Sampler (not its filters one by one) against transformers'
    TopKLogitsWarper on the same logits: it draws only the tokens transformers keeps, and each as
    often as the softmax of transformers' warped scores says."""
    logits = LOGITS[:60] / 3  # flat enough that the k tokens all have a real chance
    warped = TopKLogitsWarper(k)(None, torch.tensor(logits)[None])[0]
    expected = torch.softmax(warped.double(), -1).numpy()
    picks = draws(GenerationConfig(temperature=1.0, top_k=k, seed=11), 20000, logits)
    assert set(picks) == set(np.flatnonzero(expected > 0))
    np.testing.assert_allclose(np.bincount(picks, minlength=logits.size) / 20000, expected, atol=0.015)


def test_a_tiny_temperature_is_greedy_without_overflow():
    """Scaling by 5e-324 (the smallest float) would overflow the logits to inf, and inf - inf makes the probabilities
    nan, which draws any token: the sampler scales after subtracting the largest logit."""
    best = int(np.argmax(LOGITS))
    with np.errstate(invalid="raise"):
        assert draws(GenerationConfig(temperature=5e-324, seed=3), 20) == [best] * 20
        assert draws(GenerationConfig(temperature=5e-324, top_p=0.5, min_p=0.1, seed=3), 5) == [best] * 5


def test_the_same_seed_gives_the_same_draws_and_another_seed_does_not():
    config = GenerationConfig(temperature=1.0, seed=1234)
    assert draws(config) == draws(config)
    assert draws(config) != draws(GenerationConfig(temperature=1.0, seed=1235))
    assert len(set(draws(config))) > 10  # it really samples


def test_draws_follow_the_softmax_of_the_scaled_logits():
    logits = np.array([0.0, 1.0, 2.0, 3.0], np.float32)
    for temperature in (0.5, 1.0, 2.0):
        picks = draws(GenerationConfig(temperature=temperature, seed=5), 20000, logits)
        expected = np.exp(logits / temperature) / np.exp(logits / temperature).sum()
        np.testing.assert_allclose(np.bincount(picks, minlength=4) / 20000, expected, atol=0.012)


def kept_by_edgeinfer(config):
    scores = sampling.penalize(LOGITS, [], 1.0).astype(np.float64) / config.temperature
    ids = sampling.top_k(scores, config.top_k)
    probs = sampling.softmax(scores[ids])
    return set(ids[sampling.top_p(probs, config.top_p) & sampling.min_p(probs, config.min_p)].tolist())


def kept_by_transformers(config):
    scores = torch.tensor(LOGITS)[None]
    warpers = [TemperatureLogitsWarper(config.temperature)]
    warpers += [TopKLogitsWarper(config.top_k)] if config.top_k else []
    warpers += [TopPLogitsWarper(config.top_p)] if config.top_p < 1 else []
    warpers += [MinPLogitsWarper(config.min_p)] if config.min_p > 0 else []
    for warper in warpers:
        scores = warper(None, scores)
    return set(torch.nonzero(torch.isfinite(scores[0])).flatten().tolist())


@pytest.mark.parametrize(
    "settings",
    [
        {"top_k": 40},
        {"top_p": 0.9},
        {"min_p": 0.05},
        {"top_k": 100, "top_p": 0.5},
        {"top_k": 200, "top_p": 0.95, "min_p": 0.02, "temperature": 0.7},
        {"top_p": 0.3, "temperature": 2.0},
    ],
)
def test_filters_keep_the_same_tokens_as_transformers(settings):
    config = GenerationConfig(**{"temperature": 1.0, **settings})
    kept = kept_by_edgeinfer(config)
    assert kept == kept_by_transformers(config)
    assert 1 <= len(kept) < LOGITS.size
    picks = set(draws(dataclasses.replace(config, seed=3), 300))
    assert picks <= kept


def test_repetition_penalty_equals_transformers():
    history = [3, 17, 17, 999, 42]
    ours = sampling.penalize(LOGITS, history, 1.3)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([history]), torch.tensor(LOGITS)[None])[0].numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert not np.array_equal(ours, LOGITS) and np.array_equal(np.delete(ours, history), np.delete(LOGITS, history))


def test_repetition_penalty_changes_the_greedy_pick():
    logits = np.array([5.0, 4.9, 0.0], np.float32)
    sample = sampling.Sampler(GenerationConfig(repetition_penalty=1.5))
    assert pick(sample, logits) == 0 and pick(sample, logits, [0]) == 1


def test_presence_and_frequency_penalties_follow_openais_definition():
    """OpenAI: logit - presence × [count > 0] - frequency × count, over the generated tokens only."""
    sampler = sampling.Sampler(GenerationConfig(presence_penalty=0.5, frequency_penalty=0.25))
    logits = np.array([1.0, 2.0, 3.0, 4.0, 5.0], np.float32)
    adjusted = sampler.adjust(logits, history=[0, 1, 4, 4], generated=[4, 4, 4, 2])
    np.testing.assert_allclose(adjusted, [1.0, 2.0, 3.0 - 0.5 - 0.25, 4.0, 5.0 - 0.5 - 0.75])
    assert logits[4] == 5.0  # the graph's logits are not changed in place
    negative = sampling.Sampler(GenerationConfig(presence_penalty=-1.0, frequency_penalty=-2.0))
    np.testing.assert_allclose(negative.adjust(logits, [], [1]), [1.0, 5.0, 3.0, 4.0, 5.0])


def test_logit_bias_is_added_and_can_ban_or_force_a_token():
    logits = np.array([1.0, 2.0, 3.0], np.float32)
    sampler = sampling.Sampler(GenerationConfig(logit_bias={0: 10.0, 2: -100}))
    np.testing.assert_allclose(sampler.adjust(logits, [], []), [11.0, 2.0, -97.0])
    assert pick(sampler, logits) == 0
    drawn = sampling.Sampler(GenerationConfig(temperature=1.0, seed=3, logit_bias={2: -100}))
    assert 2 not in {pick(drawn, logits) for _ in range(200)}


def test_greedy_logprobs_are_the_log_softmax_and_the_top_is_ranked():
    sampler = sampling.Sampler(GenerationConfig(logprobs=True, top_logprobs=3))
    token, logprobs = sampler.choose(LOGITS, want_logprobs=True)
    expected = torch.log_softmax(torch.tensor(LOGITS, dtype=torch.float64), -1).numpy()
    np.testing.assert_allclose(logprobs, expected, atol=1e-9)
    chosen = sampling.TokenLogprob.of(token, logprobs, 3)
    ranked = np.argsort(-expected)[:3]
    assert chosen.token == ranked[0] and [t for t, _ in chosen.top] == list(ranked)
    assert chosen.logprob == pytest.approx(expected[ranked[0]])


def test_sampled_logprobs_are_the_distribution_drawn_from():
    """At temperature 2 with top_k 3: log-softmax of the 3 best logits / 2; every other token -inf."""
    sampler = sampling.Sampler(GenerationConfig(temperature=2.0, top_k=3, seed=0, logprobs=True))
    token, logprobs = sampler.choose(LOGITS, want_logprobs=True)
    best = np.argsort(-LOGITS)[:3]
    expected = torch.log_softmax(torch.tensor(LOGITS[best], dtype=torch.float64) / 2, -1).numpy()
    np.testing.assert_allclose(logprobs[best], expected, atol=1e-9)
    assert np.isneginf(np.delete(logprobs, best)).all() and token in best
    assert len(sampling.TokenLogprob.of(token, logprobs, 5).top) == 3  # no -inf alternatives
