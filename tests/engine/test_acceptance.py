"""engine.acceptance: the one estimator (engine, observer and simulator use it)."""

import random

import pytest

from engine.acceptance import (ENGINE_DECAY, ENGINE_PRIOR_TRIALS, AcceptanceEstimate, posterior)


def test_the_engine_estimate_is_an_ewma_of_pooled_counts():
    """Decayed sums with prior weight 1/decay equal the EWMA of (accepted, trials) per step that
    the engine used before (x += d (accepted - x), y += d (trials - y), a = x / y)."""
    est = AcceptanceEstimate(0.7, ENGINE_PRIOR_TRIALS, ENGINE_DECAY)
    x, y = 0.7, 1.0
    rng = random.Random(0)
    for _ in range(500):
        k = rng.randint(1, 6)
        acc = sum(1 for _ in range(k) if rng.random() < 0.4)
        trials = acc + (acc < k)
        est.observe(acc, trials)
        x += ENGINE_DECAY * (acc - x)
        y += ENGINE_DECAY * (trials - y)
        assert est.value == pytest.approx(x / y, rel=1e-9)
    est.reset()
    assert est.value == pytest.approx(0.7)


def test_decay_forgets_and_no_decay_keeps_the_prior():
    fading = AcceptanceEstimate(0.9, 50.0, 0.05)
    keeping = AcceptanceEstimate(0.9, 50.0, 0.0)
    for _ in range(200):
        fading.observe(2, 10)
        keeping.observe(2, 10)
    assert fading.value == pytest.approx(0.2, abs=1e-3)
    assert keeping.value == pytest.approx((45 + 400) / (50 + 2000))
    with pytest.raises(ValueError):
        AcceptanceEstimate(1.5, 10.0)


def test_posterior_shrinks_toward_the_prior():
    assert posterior(0, 0, 0.6, 4.0) == 0.6
    assert posterior(10, 10, 0.6, 4.0) == pytest.approx((10 + 2.4) / 14)
