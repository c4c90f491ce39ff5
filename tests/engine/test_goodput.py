"""Drafting judged by what it delivers (engine/goodput.py): the check alone on given step times,
and in the engine, where a drafting step's cost the step-cost model does not see turns
drafting off while the model says it pays, and back on once that cost is gone."""

import pytest

from engine.goodput import GoodputCheck, _Regime
from engine.sampling_params import RequestOptions, SamplingParams


def _drive(check: GoodputCheck, steps: int, rate: dict[bool, float], a: float = 0.8) -> list:
    """Run `steps` judged steps; a step drafting delivers rate[True] tokens a second, capped
    rate[False]. Returns whether each step was allowed to draft."""
    allowed = []
    for _ in range(steps):
        draft = check.allow(a)
        allowed.append(draft)
        check.observe(tokens=10, seconds=10 / rate[draft])
    return allowed


def test_drafting_that_delivers_less_is_capped_and_drafting_that_pays_stays():
    check = GoodputCheck(window_steps=4, pairs=3, recheck_steps=64)
    _drive(check, 4 * 2 * 3, {True: 90.0, False: 100.0})
    assert check.verdict(0.8) is False
    assert not any(_drive(check, 32, {True: 90.0, False: 100.0}))    # capped after the verdict
    fresh = GoodputCheck(window_steps=4, pairs=3, recheck_steps=64)
    _drive(fresh, 24, {True: 150.0, False: 100.0})
    assert fresh.verdict(0.8) is True and all(_drive(fresh, 32, {True: 150.0, False: 100.0}))


def test_a_tie_goes_to_plain_decoding():
    """Within the margin drafting does not pay: never slower than plain decoding."""
    check = GoodputCheck(window_steps=4, pairs=3, margin=0.02)
    _drive(check, 24, {True: 101.0, False: 100.0})
    assert check.verdict(0.8) is False


def test_a_batch_must_gain_the_k_rules_batch_margin():
    """A sequence alone keeps drafting that gains 4%; a batch needs the k rule's 5% (MIN_GAIN),
    for the reasons the rule has it (docs/decisions/0009-k-rule.md)."""
    check = GoodputCheck(window_steps=4, pairs=3)
    for batch in (1, 16):
        for _ in range(24):
            draft = check.allow(0.8, batch)
            check.observe(tokens=10, seconds=10 / (104.0 if draft else 100.0))
    assert check.verdict(0.8, 1) is True and check.verdict(0.8, 16) is False


def test_a_verdict_is_rechecked_and_follows_a_change():
    check = GoodputCheck(window_steps=4, pairs=2, recheck_steps=32)
    _drive(check, 16, {True: 80.0, False: 100.0})
    assert check.verdict(0.8) is False
    allowed = _drive(check, 400, {True: 200.0, False: 100.0})    # the draft got faster
    assert check.verdict(0.8) is True and allowed[-16:].count(False) <= 4   # a recheck window
    # a recheck costs one window of the alternative in each recheck_steps + a pair's steps
    check = GoodputCheck(window_steps=16)
    allowed = _drive(check, 20000, {True: 200.0, False: 100.0})
    assert allowed[-10000:].count(False) / 10000 < 0.01


def test_regimes_are_judged_apart():
    """A shift of acceptance to another regime is judged afresh, not by the old verdict."""
    check = GoodputCheck(window_steps=4, pairs=2)
    _drive(check, 16, {True: 80.0, False: 100.0}, a=0.35)
    assert check.verdict(0.35) is False and check.verdict(0.85) is None
    _drive(check, 16, {True: 150.0, False: 100.0}, a=0.85)
    assert check.verdict(0.85) is True and check.verdict(0.35) is False


def test_a_larger_batch_is_judged_afresh():
    """Drafting that pays for 2 sequences can lose for 32 (verification is no longer free):
    the verdict of a small batch does not carry over to a large one, nor back."""
    check = GoodputCheck(window_steps=4, pairs=2, recheck_steps=4096)
    small, large = (lambda a, b=2: check.allow(a, b)), (lambda a: check.allow(a, 32))
    for allow, rate in ((small, {True: 150.0, False: 100.0}), (large, {True: 95.0, False: 100.0})):
        for _ in range(16):
            draft = allow(0.8)
            check.observe(tokens=10, seconds=10 / rate[draft])
    assert check.verdict(0.8, 2) is True and check.verdict(0.8, 32) is False
    assert check.verdict(0.8, 3) is True and check.verdict(0.8, 40) is False   # the same bins
    assert check.verdict(0.8, 8) is None
    assert check.allow(0.8, 2) and not check.allow(0.8, 32)


@pytest.mark.slow
def test_the_engine_stops_drafting_where_a_hidden_cost_makes_it_lose(make_engine, tiny_family):
    """The target is its own draft (every draft accepted) and each target forward sleeps
    4 ms, so the step-cost model, calibrated on the steps' timed parts, says drafting pays.
    Every drafting step then also sleeps 40 ms outside those parts: drafting delivers less
    than plain decoding, and the check caps it (the router is told: `drafting_pays` False).
    With the sleep gone, the recheck finds drafting pays again and lets it draft.
    Breakage that turns it red: `_choose_k` not consulting the check (drafting never stops),
    or the check judging the model's prediction rather than the measured steps."""
    from engine.calibration import CalibratedCost
    from engine.step_cost import LinearCost, LinearStepCost

    engine = make_engine(draft=tiny_family["target"], fault_injection=True, profile=False)
    # a profile in which the draft is cheap next to the target (as the delayed target makes it)
    engine.cost = CalibratedCost(LinearStepCost(LinearCost(5e-3, 1e-4, 1e-5),
                                                LinearCost(3e-4, 1e-5, 1e-6)), draft_excess=True)
    engine.drafting.goodput = GoodputCheck(window_steps=4, pairs=2, recheck_steps=48)
    engine.set_delay("target", 0.004)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    added = 0

    def run(steps: int) -> list[bool]:
        """Steps of a batch of four speculative requests (a finished one is replaced)."""
        nonlocal added
        drafted = []
        for _ in range(steps):
            while len(engine.seqs) < 4:
                engine.add_request(f"r{added}", [5, 7, 9, 11 + added % 50], params,
                                   RequestOptions("speculative", k_max=4))
                added += 1
            engine.step()
            drafted.append(engine._step_drafted)
        return drafted

    run(40)                                        # calibrated: drafting pays in the model
    assert engine.drafting.goodput.verdict(engine.global_acceptance, 4) is True
    engine.set_delay("drafted_step", 0.040)
    drafted = run(120)
    assert engine.drafting.goodput.verdict(engine.global_acceptance, 4) is False
    assert engine.stats().drafting_pays is False
    assert drafted[-16:].count(True) <= 4          # capped but for a recheck window
    engine.set_delay("drafted_step", 0.0)
    drafted = run(160)
    assert engine.drafting.goodput.verdict(engine.global_acceptance, 4) is True
    assert drafted[-8:].count(True) >= 4           # drafting but for a recheck's capped window


def _speculative_batch(engine, n: int, steps: int, tokens: int = 400) -> None:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(n):
        engine.add_request(f"s{i}", [5, 7, 9, 11 + i], params, RequestOptions("speculative", k_max=3))
    for _ in range(steps):
        engine.step()


def test_a_capped_window_does_not_compute_the_k_rule(make_engine):
    """Where the check has judged drafting to lose, its capped windows settle k = 0 before the
    k rule or its inputs are computed (at a large batch the rule costs a few percent of a
    step). Red if the rule runs first and the check only caps its answer."""
    engine = make_engine(adaptive_k=True, profile=False)
    calls = []
    rule = engine.scheduler.choose_k
    engine.scheduler.choose_k = lambda *a, **kw: calls.append(1) or rule(*a, **kw)
    for a in range(10):                       # every regime judged: drafting loses
        for b in range(1, 8):
            engine.drafting.goodput.regimes[(a, b)] = _Regime(pays=False)
    _speculative_batch(engine, 4, 40)
    assert len(calls) <= 2                    # the k rule's probe only


def test_steps_in_which_the_k_rule_declines_to_draft_are_judged_too(make_engine):
    """The windows compare the k rule's choices against no drafting over every step in which a
    sequence may draft, so a regime where the rule drafts nothing is judged rather than left
    unjudged. Red if only the steps in which the rule wants to draft are counted. Both kinds of
    window then run the same plain steps, so which way the verdict falls is the clock's noise
    (the check cannot tell a tie from a 5% gain in four 1 ms steps): only that it is reached is
    asserted."""
    from engine.calibration import CalibratedCost
    from engine.step_cost import LinearCost, LinearStepCost

    engine = make_engine(adaptive_k=True, profile=False)
    # a draft priced at 1 s a round: the k rule never wants to draft
    engine.cost = CalibratedCost(LinearStepCost(LinearCost(1e-3, 0.0, 0.0), LinearCost(1.0, 0.0, 0.0)),
                                 draft_excess=True)
    engine.drafting.goodput = GoodputCheck(window_steps=4, pairs=2)
    _speculative_batch(engine, 4, 40)
    assert engine.metrics.data.num_drafts == 0
    assert engine.drafting.goodput.verdict(engine.global_acceptance, 4) is not None
