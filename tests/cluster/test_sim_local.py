"""The local-cpu scenario's step-cost fit (non-negative least squares), robust to samples taken
on a shared machine."""

import random

import pytest

from cluster.sim.local import fit_linear, robust_fit
from engine.cost_model import LinearCost


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


def test_linear_fit_recovers_coefficients():
    true = LinearCost(2e-3, 1e-5, 3e-6, 1e-8)
    rng = random.Random(0)
    samples = [(n, n * t, c, true(n, n * t, c)) for n, t, c in
               ((rng.randint(1, 64), rng.randint(1, 9), rng.randint(0, 50_000)) for _ in range(40))]
    fit = fit_linear(samples)
    for got, want in zip((fit.fixed_s, fit.per_seq_s, fit.per_token_s, fit.per_ctx_token_s),
                         (true.fixed_s, true.per_seq_s, true.per_token_s, true.per_ctx_token_s)):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_linear_fit_is_non_negative_and_skips_constant_columns():
    # time falls with num_seqs in the data: least squares would give a negative slope
    samples = [(n, 8, 0, 0.01 - 1e-4 * n) for n in range(1, 9)]
    fit = fit_linear(samples)
    assert min(fit.fixed_s, fit.per_seq_s, fit.per_token_s, fit.per_ctx_token_s) >= 0.0
    assert fit.per_ctx_token_s == 0.0
    with pytest.raises(ValueError):
        fit_linear([])
