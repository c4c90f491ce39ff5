"""The local-cpu scenario's step-cost fit: profile samples taken on a shared machine."""

import random

import pytest

from cluster.sim_local import robust_fit


def test_robust_fit_recovers_the_step_cost_despite_contended_samples():
    true = lambda n, t: 0.004 + 0.0003 * n + 0.0002 * t          # noqa: E731
    rng = random.Random(0)
    samples = [(n, n * q, 0, true(n, n * q) * rng.uniform(0.97, 1.03))
               for n in (1, 2, 4, 8, 16, 32) for q in (1, 2, 3, 5, 8)]
    for i in (0, 7, 13, 22):                                       # another process ran meanwhile
        n, t, c, s = samples[i]
        samples[i] = (n, t, c, s * 6)
    fit = robust_fit(samples)
    assert fit.fixed_s == pytest.approx(0.004, rel=0.1)
    assert fit.per_seq_s == pytest.approx(0.0003, rel=0.2)
    assert fit.per_token_s == pytest.approx(0.0002, rel=0.1)
