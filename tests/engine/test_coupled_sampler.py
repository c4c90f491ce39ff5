"""The Gumbel-max coupling keeps the target's distribution exactly and does not depend on k.

Statistical tests over many seeds (as tests/engine/test_rejection_sampler.py over many draws):
the emitted token follows p at every position, positions are independent, the draft's proposal
follows q and agrees with the target as often as an independent simulation of the coupling
says, and a step at any k emits what plain seeded decoding emits.
"""

import pytest
import torch
from scipy.stats import chisquare

from engine import coupled_sampler
from engine.coupled_sampler import coupled_sample, gumbel_noise, row_keys
from engine.rejection_sampler import rejection_sample

VOCAB = 6
N = 40_000
P = [torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05]), torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3]),
     torch.tensor([0.2] * 5 + [0.0]), torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.5])]
Q = [torch.tensor([0.1, 0.1, 0.4, 0.2, 0.1, 0.1]), torch.tensor([0.3, 0.3, 0.1, 0.1, 0.1, 0.1]),
     torch.tensor([0.1, 0.5, 0.1, 0.1, 0.1, 0.1])]
SEEDS = list(range(1000, 1000 + N))
START = 17           # absolute position of the first sampled token


def _chi2_p(samples, probs):
    counts = torch.bincount(torch.as_tensor(samples), minlength=len(probs)).double()
    expected = probs.double() / probs.double().sum() * len(samples)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero probability was emitted"
    return chisquare(counts[keep].numpy(), expected[keep].numpy()).pvalue


def _coupled_step(k: int):
    """N sequences (one per seed) at positions START..START+k: drafts from q, verify against p."""
    drafts = torch.stack([coupled_sample(Q[j].repeat(N, 1), SEEDS, [START + j] * N)
                          for j in range(k)], 1)                               # [N, k]
    choice = torch.stack([coupled_sample(P[j].repeat(N, 1), SEEDS, [START + j] * N)
                          for j in range(k + 1)], 1)                           # [N, k + 1]
    accepted, out = rejection_sample(drafts.reshape(-1), [k] * N, choice.reshape(-1), [True] * N,
                                     None, None, None, [None] * N)
    return drafts, choice, accepted, out


def test_noise_is_standard_gumbel_and_a_pure_function():
    keys = row_keys([5, 5, 6], [3, 4, 3], "cpu")
    g = gumbel_noise(keys, 50_000)
    assert torch.equal(g, gumbel_noise(row_keys([5, 5, 6], [3, 4, 3], "cpu"), 50_000))
    assert len(set(keys.tolist())) == 3
    for row in g:
        assert abs(row.mean().item() - 0.5772) < 0.02                   # Euler-Mascheroni
        assert abs(row.var().item() - torch.pi ** 2 / 6) < 0.06
    assert abs(torch.corrcoef(g)[0, 1:].abs().max().item()) < 0.02      # positions, seeds
    # Seeds beyond 32 bits and negative seeds are distinct keys too.
    big = row_keys([1, 1 + (1 << 32), -1, (1 << 64) - 1], [0] * 4, "cpu").tolist()
    assert big[0] != big[1] and big[2] == big[3]                        # -1 is 2^64 - 1


@pytest.mark.parametrize("position", [0, START, 1 << 20])
def test_plain_coupled_sample_follows_p(position):
    for p in P:
        tokens = coupled_sample(p.repeat(N, 1), SEEDS, [position] * N)
        assert _chi2_p(tokens, p) > 1e-3


def test_consecutive_positions_are_independent():
    """Pairs of tokens at positions t, t+1 follow p1 x p2 (fails when noise repeats by position)."""
    t1 = coupled_sample(P[0].repeat(N, 1), SEEDS, [START] * N)
    t2 = coupled_sample(P[0].repeat(N, 1), SEEDS, [START + 1] * N)
    joint = torch.outer(P[0], P[0]).reshape(-1)
    assert _chi2_p(t1 * VOCAB + t2, joint) > 1e-3


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_step_follows_p_and_equals_plain_decoding(k):
    drafts, choice, accepted, out = _coupled_step(k)
    assert _chi2_p([o[0] for o in out], P[0]) > 1e-3
    second = [o[1] for o in out if len(o) > 1]              # exists when the first draft held
    assert _chi2_p(second, P[1]) > 1e-3
    # Token for token what plain (k = 0) seeded decoding emits at those positions.
    for n, o in enumerate(out[:2000]):
        assert o == choice[n, :len(o)].tolist()
    # The draft's proposals follow q.
    assert _chi2_p(drafts[:, 0], Q[0]) > 1e-3


def test_acceptance_is_the_couplings():
    """P(draft == target) matches an independent simulation of the coupling (torch's own
    Gumbel draws); a draft with noise independent of the target's accepts far less often."""
    _, _, accepted, _ = _coupled_step(1)
    observed = sum(a > 0 for a in accepted) / N
    torch.manual_seed(0)
    g = -torch.log(-torch.log(torch.rand(400_000, VOCAB, dtype=torch.float64)))
    expected = ((P[0].double().log() + g).argmax(-1) == (Q[0].double().log() + g).argmax(-1))
    expected = expected.double().mean().item()
    independent = (P[0] * Q[0]).sum().item()
    assert abs(observed - expected) < 0.01, (observed, expected)
    assert expected > independent + 0.1
    assert observed <= torch.minimum(P[0], Q[0]).sum().item() + 0.01    # at most rejection's


def test_the_tests_catch_wrong_rules(monkeypatch):
    """Mutations of the rule turn the tests above red (kept here so they stay checked)."""
    real = coupled_sampler.row_keys
    monkeypatch.setattr(coupled_sampler, "row_keys",             # noise reused across positions
                        lambda seeds, positions, device: real(seeds, [0] * len(seeds), device))
    with pytest.raises(AssertionError):
        test_consecutive_positions_are_independent()
    with pytest.raises(AssertionError):
        test_speculative_step_follows_p_and_equals_plain_decoding(1)
    monkeypatch.setattr(coupled_sampler, "row_keys", real)
    calls = []

    def independent_draft(probs, seeds, positions):             # draft noise not the target's
        calls.append(1)
        shift = 7919 if len(calls) % 2 else 0
        return real_sample(probs, [s + shift for s in seeds], positions)

    real_sample = coupled_sampler.coupled_sample
    monkeypatch.setitem(globals(), "coupled_sample", independent_draft)
    with pytest.raises(AssertionError):
        test_acceptance_is_the_couplings()
