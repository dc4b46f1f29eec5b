"""The sampler on hand-made logits, and its filters against transformers' own logits processors."""
import dataclasses

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from edgeinfer import GenerationConfig
from edgeinfer.sdk import sampling

LOGITS = np.random.default_rng(0).normal(0, 3, 1000).astype(np.float32)


def draws(config, n=50, logits=LOGITS):
    sample = sampling.make_sampler(config)
    return [sample(logits, []) for _ in range(n)]


def test_greedy_picks_the_largest_logit_whatever_the_seed():
    best = int(np.argmax(LOGITS))
    assert draws(GenerationConfig(), 5) == [best] * 5
    assert draws(GenerationConfig(seed=9), 5) == [best] * 5


@pytest.mark.parametrize("k", [2, 5, 40])
def test_top_k_sampling_at_temperature_1_draws_like_transformers_warper(k):
    """The sampler built by make_sampler (not its filters one by one) against transformers'
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


@pytest.mark.parametrize("settings", [
    {"top_k": 40}, {"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 100, "top_p": 0.5},
    {"top_k": 200, "top_p": 0.95, "min_p": 0.02, "temperature": 0.7}, {"top_p": 0.3, "temperature": 2.0},
])
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
    sample = sampling.make_sampler(GenerationConfig(repetition_penalty=1.5))
    assert sample(logits, []) == 0 and sample(logits, [0]) == 1
