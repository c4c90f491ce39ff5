"""engine.calibration: what the engine learns of its step costs while serving."""

import json

import pytest

from engine.calibration import CalibratedCost
from engine.step_cost import LinearCost, LinearStepCost, step_s


def test_calibrated_cost_adds_what_the_engine_learnt_and_round_trips():
    from engine.calibration import step_cost_from_dict

    base = LinearStepCost(LinearCost(1e-2, 2e-4, 5e-4), LinearCost(1e-3, 1e-5, 2e-5))
    cost = CalibratedCost(base, per_seq_s=3e-3)
    assert cost.target_s(4, 8) == pytest.approx(base.target_s(4, 8) + 4 * 3e-3)
    assert cost.draft_s(4, 4) == base.draft_s(4, 4)
    assert step_cost_from_dict(json.loads(json.dumps(cost.to_dict()))) == cost


def test_the_forgetful_ratio_is_a_weighted_least_squares_fit_through_the_origin():
    """`ForgetfulRatio`, the one estimator behind per_seq_s and spec_scale: sum(w x y) /
    (sum(w x^2) + prior), pair i of n weighted forget^(n - 1 - i); `hold` keeps the weight left
    after one more pair's forgetting and moves the ratio to the value held."""
    from engine.calibration import ForgetfulRatio

    pairs = [(1.0, 2.0), (4.0, 3.0), (2.0, 5.0), (8.0, 1.0)]
    for forget, prior in ((0.9, 0.0), (0.98, 32.0), (1.0, 0.0)):
        ratio = ForgetfulRatio(forget, prior)
        for x, y in pairs:
            ratio.observe(x, y)
        w = [forget ** (len(pairs) - 1 - i) for i in range(len(pairs))]
        sxx = sum(wi * x * x for wi, (x, _) in zip(w, pairs))
        sxy = sum(wi * x * y for wi, (x, y) in zip(w, pairs))
        assert ratio.value == pytest.approx(sxy / (sxx + prior), rel=1e-12)
        ratio.hold(0.5)
        assert ratio.value == pytest.approx(0.5) and ratio.sxx == pytest.approx(forget * sxx)


def test_without_flags_calibration_learns_only_the_overhead():
    """CalibratedCost(base) moves per_seq_s by an EWMA of the residual and never rescales
    drafting."""
    from engine.calibration import OVERHEAD_EWMA

    base = LinearStepCost(LinearCost(1e-3, 1e-5, 1e-6), LinearCost(1e-4, 1e-6, 1e-7))
    cost = CalibratedCost(base)
    ks, ctx = [3, 3, 0], 300
    truth = 1.3 * step_s(ks, base, ctx) + 3 * 5e-4
    cost.calibrate(ks, ctx, truth)
    residual = (truth - step_s(ks, base, ctx)) / 3
    assert cost.per_seq_s == pytest.approx(OVERHEAD_EWMA * residual)
    for _ in range(200):
        cost.calibrate(ks, ctx, truth)
    assert cost.spec_scale == 1.0 and cost.per_seq_s == pytest.approx(residual, rel=1e-3)


def test_the_engines_calibration_charges_what_only_drafting_steps_cost_to_the_draft():
    """draft_excess (the engine's): per_seq_s comes from plain steps alone; a drafting step's
    excess over that and the base's prices rescales the draft, and plain decoding keeps its
    measured price (charged per sequence, the excess made drafting look cheap: adaptive k at
    0.93x of plain decoding on reference-py, batch 32)."""

    base = LinearStepCost(LinearCost(1e-3, 1e-5, 1e-6), LinearCost(1e-4, 1e-6, 1e-7))
    cost, ctx = CalibratedCost(base, draft_excess=True), 300
    for _ in range(100):                    # plain steps: 0.5 ms a sequence beyond the base
        cost.calibrate([0] * 4, ctx, step_s([0] * 4, base, ctx) + 4 * 5e-4)
    # the prior (PER_SEQ_PRIOR) shrinks the estimate by pxx / (pxx + prior): 4% at batch 4
    assert cost.per_seq_s == pytest.approx(5e-4, rel=0.05) and cost.spec_scale == 1.0
    cost.per_seq_s = 5e-4
    ks = [3, 3, 0, 2]
    verify = base.target_s(4, 4 + sum(ks), ctx)
    drafting = step_s(ks, base, ctx) - verify
    for _ in range(3):                      # drafting really costs 1.5x what the base says
        cost.calibrate(ks, ctx, verify + 4 * 5e-4 + 1.5 * drafting)
    assert cost.spec_scale == pytest.approx(1.5, rel=1e-3)
    assert cost.per_seq_s == pytest.approx(5e-4, rel=1e-3)
    assert cost.target_s(4, 4, ctx) == pytest.approx(base.target_s(4, 4, ctx) + 4 * 5e-4, rel=1e-3)
    assert step_s(ks, cost, ctx) == pytest.approx(verify + 4 * 5e-4 + 1.5 * drafting, rel=1e-3)
    for _ in range(40):                     # it follows a change (forgetting) ...
        cost.calibrate(ks, ctx, verify + 4 * 5e-4 + 0.8 * drafting)
    assert cost.spec_scale == pytest.approx(0.8, rel=0.02)
    cost.calibrate(ks, ctx, 100.0)          # ... within its range
    assert cost.spec_scale <= 4.0


def test_a_timed_drafting_step_charges_the_draft_its_rounds_and_its_share_of_the_verify():
    """With the step's draft rounds and verify forward timed apart (the engine's steps), the
    draft is priced from them and a fixed cost outside both (under serving: the replica's event
    loop, the proxy and the client taking the cores) goes on every sequence. Untimed, an
    all-speculative load, which never runs a plain step, puts that cost on the draft, whose
    price then sits at the ceiling (docs/decisions/0010-cost-calibration.md)."""
    from engine.calibration import CAL_SCALE_RANGE

    base = LinearStepCost(LinearCost(1e-3, 1e-5, 1e-6), LinearCost(1e-4, 1e-6, 1e-7))
    ctx, ks, n, outside = 300, [3, 3, 2, 3], 4, 6e-3          # 6 ms a step outside the forwards
    verify, plain = base.target_s(n, n + sum(ks), ctx), base.target_s(n, n, ctx)
    drafting = step_s(ks, base, ctx) - verify
    rounds = 1.2 * drafting                                    # the rounds: 1.2x their price
    verify_run = 1.5 * verify                                  # the forward: 1.5x its price
    seconds = rounds + verify_run + outside
    untimed = CalibratedCost(base, draft_excess=True)
    timed = CalibratedCost(base, draft_excess=True)
    for _ in range(200):
        untimed.calibrate(ks, ctx, seconds)
        timed.calibrate(ks, ctx, seconds, draft_seconds=rounds, verify_seconds=verify_run)
    assert untimed.spec_scale == CAL_SCALE_RANGE[1] and untimed.per_seq_s == 0.0   # the defect
    # the draft: its rounds, and the forward's excess (0.5x) on what its tokens add to the price
    assert timed.spec_scale == pytest.approx((rounds + 0.5 * (verify - plain)) / drafting, rel=1e-6)
    # per sequence: the time outside the forwards and the excess on the plain share, through
    # the prior (PER_SEQ_PRIOR shrinks it by pxx / (pxx + prior): ~4% at batch 4)
    assert timed.per_seq_s == pytest.approx((outside + 0.5 * plain) / n, rel=0.05)
    # the step as priced is the step as run
    assert step_s(ks, timed, ctx) == pytest.approx(seconds, rel=0.05)
    # a forward no dearer than its price charges the draft its rounds alone
    cost = CalibratedCost(base, draft_excess=True)
    for _ in range(50):
        cost.calibrate(ks, ctx, rounds + 0.9 * verify + outside, draft_seconds=rounds,
                       verify_seconds=0.9 * verify)
    assert cost.spec_scale == pytest.approx(1.2, rel=1e-6)


def test_the_engine_does_not_calibrate_on_a_step_in_which_the_draft_prefills(make_engine):
    """The first drafting step of a sequence catches the draft up on the whole prompt; timed
    as a decode step, that prefill would be priced as drafting overhead on every later step.
    Every calibrated step says whether a speculative sequence was in it (could_draft), and
    hands over its draft rounds' and verify forward's times, parts of the step's."""
    from engine.sampling_params import RequestOptions, SamplingParams

    engine = make_engine(adaptive_k=False)             # k = 3 on every decode step
    assert engine.cost.draft_excess
    seen = []
    calibrate = engine.cost.calibrate

    def record(ks, ctx, secs, **kw):
        seen.append((list(ks), kw["could_draft"]))
        drafted, verified = kw["draft_seconds"], kw["verify_seconds"]
        assert (drafted > 0) == any(ks) and verified > 0 and drafted + verified < secs
        calibrate(ks, ctx, secs, **kw)

    engine.cost.calibrate = record
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("r", list(range(5, 45)), params, RequestOptions("speculative", k_max=3))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    # step 1 prefills the target (not a decode step), step 2 the draft (40 prompt tokens)
    assert steps > 4 and len(seen) == steps - 2
    assert all(could for _, could in seen)
    seen.clear()
    engine.add_request("b", list(range(5, 45)), params, RequestOptions("baseline"))
    while engine.has_unfinished():
        engine.step()
    assert seen and not any(could for _, could in seen)


def test_a_fixed_excess_at_a_small_batch_is_not_priced_per_sequence_at_a_large_one():
    """draft_excess's per_seq_s weights plain steps by their batch: a draining batch of 2 that
    runs 2 ms over the table must not price every sequence of a batch of 32 at 1 ms, as an
    EWMA of residual / n would (docs/decisions/0010-cost-calibration.md)."""

    base = LinearStepCost(LinearCost(1e-3, 1e-5, 1e-6), LinearCost(1e-4, 1e-6, 1e-7))
    cost, ctx = CalibratedCost(base, draft_excess=True), 300
    for _ in range(60):
        cost.calibrate([0] * 32, ctx, step_s([0] * 32, base, ctx))            # as the table says
    for _ in range(10):
        cost.calibrate([0] * 2, ctx, step_s([0] * 2, base, ctx) + 2e-3)       # the tail of a batch
    assert cost.target_s(32, 32, ctx) - base.target_s(32, 32, ctx) < 0.1 * 32 * 1e-3


def test_one_slow_first_step_does_not_set_the_per_sequence_price():
    """The first decode step of a process runs slow (first-use costs: 6.8 against 4.3 ms at
    batch 1 on reference-py). With nothing else seen it set per_seq_s to 2.9 ms; a load that
    only speculates has no later plain step to correct it, and at batch 32 that price left no
    time for drafting: spec_scale fell to its floor and adaptive k ran at 0.7x of plain
    decoding. The prior keeps one step from setting the price; real overhead still shows."""

    base = LinearStepCost(LinearCost(1e-3, 1e-5, 1e-6), LinearCost(1e-4, 1e-6, 1e-7))
    cost, ctx = CalibratedCost(base, draft_excess=True), 300
    cost.calibrate([0], ctx, step_s([0], base, ctx) + 3e-3)
    assert cost.per_seq_s < 2e-4
    for _ in range(100):                    # a real 0.1 ms a sequence at batch 32
        cost.calibrate([0] * 32, ctx, step_s([0] * 32, base, ctx) + 32 * 1e-4)
    assert cost.per_seq_s == pytest.approx(1e-4, rel=0.02)


def test_a_draft_price_learnt_at_one_load_is_not_kept_while_nothing_drafts():
    """Drafting learnt dear (batch 8 here, 32 on reference-py) holds k at 0; with nobody
    drafting nothing would correct it, and at batch 1 afterwards the engine never drafted again
    (0.96x of plain decoding, acceptance 0, where it had run 1.31x). Steps of speculative
    sequences that do not draft, at under half or over twice the batch the price was learnt at,
    pull it back to the profile's; at the same load it stays (drifting there made k = 0 retry
    drafting every few dozen steps: 0.86x of plain decoding on reference-py-deep at batch 16);
    steps of baseline sequences alone leave it."""

    base = LinearStepCost(LinearCost(1e-3, 1e-5, 1e-6), LinearCost(1e-4, 1e-6, 1e-7))
    cost, ctx = CalibratedCost(base, draft_excess=True), 300
    ks = [2] * 8
    verify = base.target_s(8, 8 + sum(ks), ctx)
    for _ in range(20):
        cost.calibrate(ks, ctx, verify + 3.0 * (step_s(ks, base, ctx) - verify))
    assert cost.spec_scale == pytest.approx(3.0, rel=1e-3)
    for n, could in ((1, False), (8, True), (5, True), (16, True)):
        for _ in range(100):
            cost.calibrate([0] * n, ctx, step_s([0] * n, base, ctx), could_draft=could)
        assert cost.spec_scale == pytest.approx(3.0, rel=1e-3), (n, could)
    for _ in range(100):
        cost.calibrate([0], ctx, step_s([0], base, ctx), could_draft=True)
    assert cost.spec_scale < 1.5
    for _ in range(3):                      # still dear: learnt again at once
        cost.calibrate(ks, ctx, verify + 3.0 * (step_s(ks, base, ctx) - verify))
    assert cost.spec_scale > 2.5
