"""The accept/reject rule keeps the target's distribution exactly (statistical tests)."""

import pytest
import torch
from scipy.stats import chisquare

from engine.rejection_sampler import rejection_sample

VOCAB = 6
N = 40_000


def _run(p_rows, q_rows, k):
    """N sequences, each with k drafts sampled from q; returns emitted tokens per sequence."""
    torch.manual_seed(1)
    q = torch.stack(q_rows)                                            # [k, vocab]
    p = torch.stack(p_rows)                                            # [k + 1, vocab]
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True) for j in range(k)], 1)
    draft_ids = drafts.reshape(-1)                                     # [N * k]
    target_probs = p.repeat(N, 1)                                      # [N * (k + 1), vocab]
    draft_probs = q.repeat(N, 1)                                       # [N * k, vocab]
    accepted, out = rejection_sample(
        draft_ids, [k] * N, target_probs.argmax(-1), [False] * N, target_probs, draft_probs,
        torch.rand(N * k), [None] * N)
    return accepted, out


def _chi2_p(samples, probs):
    counts = torch.bincount(torch.tensor(samples), minlength=VOCAB).double()
    expected = probs.double() / probs.double().sum() * len(samples)
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    return chisquare(counts[keep].numpy(), expected[keep].numpy()).pvalue


@pytest.mark.parametrize("k", [1, 3])
def test_first_and_second_token_follow_the_target(k):
    p = [torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05]), torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3]),
         torch.tensor([0.2] * 5 + [0.0]), torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.5])]
    q = [torch.tensor([0.1, 0.1, 0.4, 0.2, 0.1, 0.1]), torch.tensor([0.3, 0.3, 0.1, 0.1, 0.1, 0.1]),
         torch.tensor([0.1, 0.5, 0.1, 0.1, 0.1, 0.1])]
    accepted, out = _run(p[:k + 1], q[:k], k)
    assert _chi2_p([o[0] for o in out], p[0]) > 1e-3
    # The second emitted token exists when the first draft was accepted; it then follows p_2.
    second = [o[1] for o in out if len(o) > 1]
    if k >= 1 and second:
        assert _chi2_p(second, p[1]) > 1e-3
    # Acceptance of the first draft is sum(min(p, q)).
    expected = torch.minimum(p[0], q[0]).sum().item()
    observed = sum(a > 0 for a in accepted) / N
    assert abs(observed - expected) < 0.01


def test_greedy_accepts_while_argmax_agrees():
    # Target argmax rows: seq0 owns rows 0..3 (k=3), seq1 rows 4..6 (k=2), seq2 row 7 (k=0).
    target = torch.tensor([3, 1, 4, 2, 0, 5, 5, 2])
    drafts = torch.tensor([3, 1, 0, 0, 1])
    accepted, out = rejection_sample(drafts, [3, 2, 0], target, [True] * 3, None, None, None, [None] * 3)
    assert accepted == [2, 1, 0]                         # seq0: 0 != 4; seq1: 0 ok, 1 != 5
    assert out == [[3, 1, 4], [0, 5], [2]]               # accepted drafts + the target's token
