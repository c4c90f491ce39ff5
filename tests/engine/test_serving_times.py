"""`ServingTimes`: where a served engine's time goes outside what it calibrates on (its steps
against their profile's prices, the loop's time between steps, a request's time in the
engine), which `bench serve` reads per window and `simulate --scenario local-cpu` times with."""

import time

import pytest

from engine.calibration import CalibratedCost
from engine.sampling_params import Mode, RequestOptions, SamplingParams
from engine.step_cost import LinearCost, LinearStepCost

PROMPT = [5, 9, 13, 17, 21, 25, 29, 33]


def _drain(engine) -> int:
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps


def test_steps_are_priced_as_run_and_idle_time_is_no_gap(make_engine):
    engine = make_engine(draft=False)
    # prices with a context term, so that the context each step is priced at counts
    base = LinearStepCost(LinearCost(1e-2, 2e-4, 5e-4, 1e-5), LinearCost(1e-3, 0.0, 0.0))
    engine.cost = CalibratedCost(base, draft_excess=True)
    engine.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    steps = _drain(engine)
    s = engine.stats().serving
    assert steps == s.steps == engine.snapshot().num_steps == 6   # the prompt's step, then 5
    # the prompt's step over its 8 tokens, then one token a step at a context one longer each
    priced = base.target_s(1, 8, 8) + sum(base.target_s(1, 1, 8 + j) for j in range(1, 6))
    assert s.priced_target_s == pytest.approx(priced)
    assert s.priced_draft_s == s.draft_s == 0.0
    assert s.gaps == 5 and 0 < s.gap_s < s.step_s     # between back-to-back steps only
    assert s.requests == 1 and s.step_s <= s.request_s
    # an idle spell is the callers' wait, not the loop's: no gap before the next request's step
    time.sleep(0.3)
    engine.add_request("b", PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    _drain(engine)
    t = engine.stats().serving
    assert t.gaps == 5 + 2 and t.gap_s - s.gap_s < 0.1
    assert t.requests == 2 and t.request_s - s.request_s < 0.3   # from add_request, not before


def test_a_drafting_step_prices_its_rounds_and_the_catch_up(make_engine):
    engine = make_engine(adaptive_k=False)
    engine.add_request("s", PROMPT, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
                       RequestOptions(mode=Mode.SPECULATIVE, k_max=2))
    _drain(engine)
    s, m = engine.stats().serving, engine.snapshot()
    base = engine.cost.base
    rounds = m.num_draft_tokens                     # k = 2 a step, fewer near max_tokens
    assert rounds >= 4 and s.draft_s > 0
    one = base.draft_s(1, 1, 0)                     # a round feeding one token (no context price)
    per_token = base.draft_s(1, 2, 0) - one
    # the first drafting step's first round reads the 9 tokens its draft has not seen (the
    # prompt and the first token): 8 tokens more than a round on time; later first rounds
    # feed the 1-2 tokens of the last step
    assert rounds * one + 8 * per_token <= s.priced_draft_s + 1e-12
    assert s.priced_draft_s <= rounds * one + (8 + m.num_drafts) * per_token + 1e-12
