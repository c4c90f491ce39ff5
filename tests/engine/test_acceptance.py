"""engine.acceptance: the one estimator (engine, observer and simulator use it), and what the
engine feeds it."""

import random

import pytest

from engine.acceptance import (ENGINE_DECAY, ENGINE_PRIOR_TRIALS, AcceptanceEstimate, posterior)
from engine.sampling_params import RequestOptions, SamplingParams


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


def test_the_engine_estimate_pools_its_steps_accepted_and_tried_counts(make_engine):
    """The engine's live estimate is exactly the estimator fed each drafting step's accepted
    and tried counts, replayed here from the request's cumulative counts: a step of k drafts
    that accepts `accepted` tried `accepted + (accepted < k)` of them (the drafts after the
    first rejection were never tried). The request's own trials count the same way.

    Breaks when `_apply` counts all k drafts as trials (`trials = it.k`): the estimate runs low
    (0.32 against 0.61 in one run) and drives adaptive k and the router with it. Breaks as well
    when a step that accepts all k counts a trial more (`trials = r.accepted + 1`)."""
    engine = make_engine(adaptive_k=False)
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=60,
                       ignore_eos=True), RequestOptions("speculative", k_max=4))
    replay = AcceptanceEstimate(engine.config.prior_acceptance, ENGINE_PRIOR_TRIALS, ENGINE_DECAY)
    seen = {"all": 0, "early_rejection": 0}
    drafted = accepted = tried = 0
    while engine.has_unfinished():
        for o in engine.step():
            k, a = o.num_draft_tokens - drafted, o.num_accepted_tokens - accepted
            t = o.num_draft_trials - tried
            drafted, accepted, tried = o.num_draft_tokens, o.num_accepted_tokens, o.num_draft_trials
            if not k:
                continue
            assert t == a + (a < k), (k, a, t)
            replay.observe(a, a + (a < k))
            seen["all"] += a == k
            seen["early_rejection"] += a < k - 1
            assert engine.global_acceptance == pytest.approx(replay.value, rel=1e-12)
    assert seen["all"] and seen["early_rejection"], seen    # both kinds of step were checked
