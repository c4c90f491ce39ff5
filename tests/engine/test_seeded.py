"""A seeded request's text depends on (seed, prompt, sampling settings) only: never on k,
adaptive k, the mode, or the other requests in its batch (the coupled sampler).

Adaptive-k engines start from a high prior acceptance so that they draft on this noisy machine
(their k then varies with measured step times, which is the point)."""

import random

import pytest

from conftest import run_all
from engine.sampling_params import RequestOptions, SamplingParams

PROMPTS = [[5 + i, 7, 9 + 2 * i, 11] * (1 + i % 3) + [20 + i] * (i % 2) for i in range(6)]
N_NEW = 20


def _params(i: int, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.8)
    if i % 3 == 2:
        kw.setdefault("top_p", 0.9)
    if i % 3 == 1:
        kw.setdefault("top_k", 20)
    kw.setdefault("seed", 1234 + i)
    return SamplingParams(max_tokens=N_NEW, ignore_eos=True, **kw)


def _alone(engine, mode: str, k_max: int) -> list[list[int]]:
    out = []
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"s{i}", p, _params(i), RequestOptions(mode=mode, k_max=k_max))
        outs, _ = run_all(engine)
        out.append(outs[f"s{i}"])
    return out


@pytest.fixture(scope="module")
def plain(make_engine):
    """Plain seeded decoding (k = 0, the standard tier), one request at a time."""
    return _alone(make_engine(draft=False), "baseline", 0)


def test_seeds_give_different_text_and_repeat(make_engine, plain):
    assert len({tuple(o) for o in plain}) == len(PROMPTS)
    again = _alone(make_engine(draft=False), "baseline", 0)
    assert again == plain
    other = make_engine(draft=False)
    other.add_request("x", PROMPTS[0], _params(0, seed=99), RequestOptions())
    outs, _ = run_all(other)
    assert outs["x"] != plain[0]                       # the seed matters


@pytest.mark.parametrize("k", [2, 4])
def test_fixed_k_equals_plain(make_engine, plain, k):
    engine = make_engine(adaptive_k=False)
    assert _alone(engine, "speculative", k) == plain
    snap = engine.snapshot()
    assert snap.num_draft_tokens > 0 and 0 < snap.num_accepted_tokens < snap.num_draft_tokens
    # The draft proposes with the target's noise for the same position: here 0.67 of drafts
    # are accepted; with the noise of the next position instead, 0.008 (measured). The text
    # would still be right (every token is the target's), only the speed-up gone.
    assert snap.num_accepted_tokens / snap.num_draft_tokens > 0.3


def test_adaptive_k_equals_plain(make_engine, plain, tmp_path):
    engine = make_engine(profile=True, cost_cache_dir=str(tmp_path), prior_acceptance=0.95)
    assert _alone(engine, "speculative", 4) == plain
    assert engine.snapshot().num_draft_tokens > 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_batched_with_others_equals_plain(make_engine, plain, adaptive, tmp_path):
    """Seeded requests among unseeded, greedy and other seeded ones, arriving at random steps,
    in both modes with varied k_max: each seeded text is still its plain text."""
    # A cost model under which drafting pays, not a profile: with a profile measured on a busy
    # machine the adaptive rule may find drafting never pays for these tiny models (a
    # clean-clone CI run saw 0 draft tokens), and this test is about seeded outputs while
    # drafting happens.
    from engine.calibration import CalibratedCost
    from engine.step_cost import LinearCost, LinearStepCost

    engine = make_engine(adaptive_k=adaptive, profile=False, max_num_batched_tokens=64,
                         prior_acceptance=0.95)
    engine.cost = CalibratedCost(LinearStepCost(LinearCost(1e-2, 2e-4, 5e-4),
                                                LinearCost(1e-4, 2e-6, 5e-6)))
    rng = random.Random(3)
    arrivals = {}
    for i, p in enumerate(PROMPTS):
        mode = ("speculative", "baseline")[i % 2] if adaptive else "speculative"
        opts = RequestOptions(mode=mode, k_max=1 + (i * 3) % 5)
        arrivals.setdefault(rng.randrange(5), []).append((f"s{i}", p, _params(i), opts))
        other = SamplingParams(temperature=(1.0, 0.0, 0.7)[i % 3], max_tokens=N_NEW, ignore_eos=True)
        arrivals.setdefault(rng.randrange(5), []).append(
            (f"u{i}", p[::-1], other, RequestOptions(mode="speculative", k_max=3)))
    outs, _ = run_all(engine, arrivals)
    assert [outs[f"s{i}"] for i in range(len(PROMPTS))] == plain
    assert engine.snapshot().num_draft_tokens > 0
