"""Drawing a token from a distribution (`engine/sampler.sample`): the exponential race follows
the weights, on the global generator and on a request's own, and a seeded row's draws do not
depend on the rows beside it."""

import pytest
import torch
from scipy.stats import chisquare, kstest

from engine.sampler import exponential_noise, sample

P = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0])
N = 20_000


def _chi2_p(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0, "a token of weight 0 was drawn"
    keep = probs > 0
    expected = probs[keep].double() / probs[keep].double().sum() * len(tokens)
    return chisquare(counts[keep].numpy(), expected.numpy()).pvalue


def test_the_noise_is_exponential_on_either_generator():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(7)
    noise = exponential_noise(3, 40_000, [None, gen, None], "cpu")
    assert bool((noise > 0).all()) and bool(noise.isfinite().all())
    for row in noise:
        assert kstest(row.double().numpy(), "expon").pvalue > 1e-3


def test_unnormalised_weights_are_drawn_in_proportion_with_seeded_rows_among_shared_ones():
    torch.manual_seed(1)
    weights = (P * 3.0).repeat(N, 1)                     # sample() needs no normalisation
    generators = [torch.Generator().manual_seed(i) if i % 3 == 0 else None for i in range(N)]
    tokens = sample(weights, generators)
    seeded = torch.tensor([g is not None for g in generators])
    assert _chi2_p(tokens[seeded], P) > 1e-3
    assert _chi2_p(tokens[~seeded], P) > 1e-3


def test_a_seeded_row_draws_the_same_whatever_rows_share_its_batch():
    weights = torch.full((1, 64), 1 / 64)
    alone = [int(sample(weights, [torch.Generator().manual_seed(s)])) for s in range(40)]
    mixed = []
    for s in range(40):
        torch.manual_seed(100 + s)               # the shared rows draw differently each time
        rows = [None, torch.Generator().manual_seed(s), None, None]
        mixed.append(int(sample(weights.repeat(4, 1), rows)[1]))
    assert alone == mixed
    assert len(set(alone)) > 10                          # the seed matters: not one fixed token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_take_the_first_of_equal_logits(dtype):
    """The engine's greedy choice (`max(dim)`, faster than argmax on CPU) is argmax's: the
    highest logit, the first of equals, NaN-free rows as wide as a vocabulary."""
    from engine.sampler import greedy_tokens
    torch.manual_seed(0)
    logits = torch.randn(33, 8192).to(dtype)
    logits[3, [7, 4000]] = 50.0                       # a tie: the first wins
    logits[5, [8191, 100]] = 60.0
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(logits)[3] == 7 and greedy_tokens(logits)[5] == 100
