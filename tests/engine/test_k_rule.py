"""engine.k_rule: choose_k, the engine's rule, the catch-up price and the probe."""

import math
import random

import pytest

from engine.hardware import GPUS, MODELS, RooflineStepCost
from engine.k_rule import choose_k, expected_tokens
from engine.step_cost import LinearCost, LinearStepCost, step_s


@pytest.mark.parametrize("a,k,want", [(0.5, 0, 1.0), (0.5, 2, 1.75), (0.0, 4, 1.0), (1.0, 4, 5.0),
                                      (0.999999999999, 3, 4.0), (0.58, 4, (1 - 0.58**5) / 0.42)])
def test_expected_tokens(a, k, want):
    assert expected_tokens(a, k) == pytest.approx(want)


A100, L70, L7 = GPUS["A100-80GB"], MODELS["Llama-2-70B"], MODELS["Llama-2-7B"]


LINEAR = LinearStepCost(LinearCost(20e-3, 1e-5, 2e-5), LinearCost(3e-3, 1e-6, 2e-6))


def _brute_force(a, k_max, cost):
    def rate(k):
        return expected_tokens(a, k) / step_s([k], cost)
    return max(range(k_max + 1), key=lambda k: (rate(k), -k))


@pytest.mark.parametrize("cost", [LINEAR, RooflineStepCost(A100, L70, L7, tp=4, draft_tp=4),
                                  RooflineStepCost(A100, L70, L7, tp=4, draft_tp=1)])
@pytest.mark.parametrize("a", [0.0, 0.1, 0.3, 0.5, 0.58, 0.7, 0.8, 0.9, 0.97])
def test_choose_k_single_sequence_equals_brute_force(cost, a):
    for k_max in (1, 4, 8):
        assert choose_k([a], [k_max], cost) == [_brute_force(a, k_max, cost)]


def test_choose_k_zero_when_it_does_not_pay():
    assert choose_k([0.05] * 8, [8] * 8, LINEAR) == [0] * 8  # acceptance low
    dear = LinearStepCost(LINEAR.target, LinearCost(20e-3, 0.0, 0.0))  # draft as dear as the target
    assert choose_k([0.7] * 8, [8] * 8, dear) == [0] * 8
    assert choose_k([0.9, 0.9], [0, 0], LINEAR) == [0, 0]  # baseline mode
    assert choose_k([], [], LINEAR) == []


def test_a_draft_that_must_catch_up_drafts_only_where_its_tokens_pay_for_that_too():
    """A sequence whose draft skipped tokens pays for feeding them when it drafts again
    (unpriced, estimates at break-even restart the whole batch in bursts:
    docs/decisions/0009-k-rule.md)."""
    a, n = 0.8, 8
    on_time = choose_k([a] * n, [4] * n, LINEAR, max_slowdown=None)
    assert all(on_time) and choose_k([a] * n, [4] * n, LINEAR, max_slowdown=None,
                                     catch_up_s=[0.0] * n) == on_time
    # What drafting brings these sequences, in seconds of the no-draft step's rate: a catch-up
    # well below it leaves them drafting, well above it stops them.
    rate = n / step_s([0] * n, LINEAR)
    gain_s = (n * expected_tokens(a, on_time[0]) / step_s(on_time, LINEAR) - rate) \
        * step_s(on_time, LINEAR) / rate / n
    assert choose_k([a] * n, [4] * n, LINEAR, max_slowdown=None,
                    catch_up_s=[0.2 * gain_s] * n) == on_time
    assert choose_k([a] * n, [4] * n, LINEAR, max_slowdown=None,
                    catch_up_s=[3.0 * gain_s] * n) == [0] * n
    # In one batch the laggards stay off while the sequences on time draft.
    mixed = choose_k([a] * n, [4] * n, LINEAR, max_slowdown=None,
                     catch_up_s=[0.0] * 4 + [3.0 * gain_s] * 4)
    assert all(mixed[:4]) and mixed[4:] == [0] * 4


def test_choose_k_monotone_in_acceptance_and_capped():
    rng = random.Random(1)
    cost = RooflineStepCost(A100, L70, L7, tp=4, draft_tp=4)
    for _ in range(30):
        n = rng.randint(2, 40)
        accs = [round(rng.random(), 2) for _ in range(n)]
        caps = [8] * n
        ks = choose_k(accs, caps, cost, context_tokens=600 * n, max_slowdown=None)
        order = sorted(range(n), key=accs.__getitem__)
        assert all(ks[i] <= ks[j] for i, j in zip(order, order[1:]))
        assert all(0 <= k <= 8 for k in ks)
    k_small, k_large = choose_k([0.9, 0.9], [2, 5], cost)
    assert k_small <= 2 and 0 < k_large <= 5


def test_slowdown_guard_protects_the_lowest_acceptance():
    cost = RooflineStepCost(A100, L70, L7, tp=4, draft_tp=4)
    batch = [0.8] * 47 + [0.02]  # one sequence the draft cannot help
    assert max(choose_k(batch, [8] * 48, cost, 48 * 600, max_slowdown=None)) > 0  # goodput alone says go
    assert choose_k(batch, [8] * 48, cost, 48 * 600, max_slowdown=0.05) == [0] * 48
    # a baseline-mode sequence sharing the batch vetoes draft rounds that would slow it > 5%
    assert choose_k([0.8, 0.8, 0.5], [8, 8, 0], LINEAR) == [0, 0, 0]
    assert max(choose_k([0.8, 0.8, 0.5], [8, 8, 0], LINEAR, max_slowdown=None)) > 0


def test_prefill_tokens_are_not_charged_to_decoding():
    cost = RooflineStepCost(A100, L70, L7, tp=4, draft_tp=4)
    accs, caps = [0.6] * 32, [8] * 32
    plain = choose_k(accs, caps, cost, 32 * 600)
    with_prefill = choose_k(accs, caps, cost, 32 * 600, extra_tokens=2048)
    assert max(plain) > 0 and max(with_prefill) <= max(plain) + 1


def test_the_scheduler_tells_choose_k_each_drafts_catch_up_and_the_tokens_left(make_engine):
    """A draft on time (lagging by the last step's 1-2 tokens, which its round feeds anyway)
    has nothing to catch up on; one 12 tokens behind has 10; one that has never run, its whole
    context. And each sequence's tokens left, which the catch-up is spread over."""
    from engine.sampling_params import RequestOptions, SamplingParams

    engine = make_engine(adaptive_k=False)             # every draft runs every step (k = 3)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for rid in "abc":
        engine.add_request(rid, list(range(5, 25)), params, RequestOptions("speculative", k_max=3))
    for _ in range(4):
        engine.step()
    seqs = engine.seqs
    assert all(s.draft_computed > 10 and not s.in_prefill for s in seqs.values())
    seqs["b"].draft_computed = len(seqs["b"].token_ids) - 12
    seqs["c"].draft_computed = 0
    expected_left = sorted(30 - s.num_output for s in seqs.values())
    context_c = len(seqs["c"].token_ids)
    seen = []
    choose = engine.scheduler.choose_k

    def record(acc, room, context, prefill, catch_up, left):
        seen.append((sorted(catch_up), sorted(left)))
        return choose(acc, room, context, prefill, catch_up, left)

    engine.scheduler.choose_k = record
    engine.step()
    assert seen == [([0, 10, context_c], expected_left)]


def _linear_engine(make_engine):
    """An adaptive engine whose step costs are LINEAR's (no calibration moves them)."""
    from engine.calibration import CalibratedCost

    engine = make_engine(adaptive_k=True)
    engine.cost = CalibratedCost(LINEAR)
    return engine


def test_the_engine_spreads_a_catch_up_over_the_steps_the_sequence_has_left(make_engine):
    """The same catch-up is worth paying for a sequence with many tokens left and not for one
    about to finish (a straggler whose catch-up is spread over a fixed few steps lags further
    every step and never drafts again, even alone: docs/decisions/0009-k-rule.md)."""
    from engine.k_rule import PAYBACK_STEPS

    engine = _linear_engine(make_engine)
    a, n = 0.8, 8
    on_time = engine._choose_k([a] * n, [4] * n, 0, 0)
    rate = n / step_s([0] * n, LINEAR)
    gain_s = (n * expected_tokens(a, on_time[0]) / step_s(on_time, LINEAR) - rate) \
        * step_s(on_time, LINEAR) / rate / n                # what drafting brings a step
    per_token = (LINEAR.draft_s(n, 2 * n) - LINEAR.draft_s(n, n)) / n
    catch_up = round(0.3 * gain_s * PAYBACK_STEPS / per_token)   # 0.3x that over 32 steps
    long_left = engine._choose_k([a] * n, [4] * n, 0, 0, [catch_up] * n, [400] * n)
    short_left = engine._choose_k([a] * n, [4] * n, 0, 0, [catch_up] * n, [4] * n)
    assert all(on_time) and long_left == on_time and short_left == [0] * n


def test_the_engine_keeps_min_gain_and_never_splits_its_batch(make_engine):
    """`LLMEngine._choose_k` takes the rule (`engine_choose_k`) the simulator's engines share:
    a sequence that would not pay alone drafts one token beside seven that do, and a batch whose
    drafting gains under MIN_GAIN does not draft."""
    from engine.k_rule import MIN_GAIN

    engine = _linear_engine(make_engine)
    accs, caps = [0.9] * 7 + [0.0], [4] * 8
    assert choose_k(accs, caps, LINEAR, max_slowdown=None)[7] == 0     # pure goodput splits
    ks = engine._choose_k(accs, caps, 0, 0)
    assert all(ks[:7]) and ks[7] == 1
    n = 8
    plain = n / step_s([0] * n, LINEAR)
    for a, pays in ((0.2, False), (0.25, True), (0.45, True)):   # gains 3.7%, 8%, 26%
        pure = choose_k([a] * n, [4] * n, LINEAR, max_slowdown=None)
        gain = n * expected_tokens(a, pure[0]) / step_s(pure, LINEAR) / plain - 1.0
        assert all(pure) and (gain >= MIN_GAIN) == pays
        assert engine._choose_k([a] * n, [4] * n, 0, 0) == (pure if pays else [0] * n)


def test_a_sequence_alone_drafts_from_min_gain_alone(make_engine):
    """Alone, the engine drafts where that pays MIN_GAIN_ALONE (the profile's batch, no batch to
    finish unevenly), not MIN_GAIN: a gain between the two drafts alone and not in a batch."""
    from engine.k_rule import MIN_GAIN, MIN_GAIN_ALONE

    engine = _linear_engine(make_engine)
    seen = set()
    for a in [i / 100 for i in range(5, 60)]:
        pure = choose_k([a], [4], LINEAR, max_slowdown=None)
        gain = expected_tokens(a, pure[0]) / step_s(pure, LINEAR) * step_s([0], LINEAR) - 1.0
        band = "under" if gain < MIN_GAIN_ALONE else "between" if gain < MIN_GAIN else "over"
        if not any(pure) or abs(gain - MIN_GAIN_ALONE) < 1e-3 or abs(gain - MIN_GAIN) < 1e-3:
            continue
        seen.add(band)
        assert engine._choose_k([a], [4], 0, 0) == (pure if band != "under" else [0]), (a, gain)
        for n in (2, 8) if band == "between" else ():     # in a batch, MIN_GAIN holds
            batch = choose_k([a] * n, [4] * n, LINEAR, max_slowdown=None)
            batch_gain = (n * expected_tokens(a, batch[0]) / step_s(batch, LINEAR)
                          / (n / step_s([0] * n, LINEAR)) - 1.0)
            if batch_gain < MIN_GAIN:
                seen.add(f"batch {n} kept plain")
                assert engine._choose_k([a] * n, [4] * n, 0, 0) == [0] * n
    assert seen == {"under", "between", "over", "batch 2 kept plain", "batch 8 kept plain"}


def test_no_split_drafts_every_speculative_sequence_or_none():
    """With no_split, a sequence whose acceptance alone would not pay drafts one token when the
    rest of the batch drafts (a batch split into drafting and not leaves the non-drafting ones
    to finish alone: docs/decisions/0009-k-rule.md); baseline-mode sequences (k_max 0) still
    never draft."""
    accs, caps = [0.9] * 7 + [0.0], [4] * 8
    split = choose_k(accs, caps, LINEAR, max_slowdown=None)
    assert all(split[:7]) and split[7] == 0
    whole = choose_k(accs, caps, LINEAR, max_slowdown=None, no_split=True)
    assert all(whole) and whole[7] == 1
    mixed = choose_k(accs, caps[:7] + [0], LINEAR, max_slowdown=None, no_split=True)
    assert all(mixed[:7]) and mixed[7] == 0
    assert choose_k([0.0] * 8, caps, LINEAR, max_slowdown=None, no_split=True) == [0] * 8


def test_min_gain_keeps_plain_decoding_unless_drafting_beats_it_by_that_much():
    """Drafting is chosen only where its goodput beats plain decoding's by min_gain."""
    n, caps = 8, [4] * 8
    plain = n / step_s([0] * n, LINEAR)
    for a in (0.3, 0.45, 0.6, 0.75, 0.9):
        ks = choose_k([a] * n, caps, LINEAR, max_slowdown=None)
        if not any(ks):
            continue
        gain = n * expected_tokens(a, ks[0]) / step_s(ks, LINEAR) / plain - 1.0
        assert choose_k([a] * n, caps, LINEAR, max_slowdown=None, min_gain=gain * 0.9) == ks
        assert choose_k([a] * n, caps, LINEAR, max_slowdown=None, min_gain=gain * 1.1) == [0] * n


def test_largest_ks_is_the_largest_k_whose_marginal_gain_clears_the_threshold():
    """`choose_k`'s inner step, checked against its definition over a grid that includes the
    edges (a of 0 and 1, thresholds at and past 0 and 1, caps of 0)."""
    from engine.k_rule import _largest_ks

    accs = [0.0, 0.05, 0.3, 0.5, 0.71, 0.9, 0.99, 1.0]
    logs = [math.log(a) if 0.0 < a < 1.0 else 0.0 for a in accs]
    for threshold in (-0.1, 0.0, 1e-6, 0.01, 0.2, 0.5, 0.7, 0.9, 0.999, 1.0, 1.5):
        for cap in (0, 1, 3, 8):
            want = [max([k for k in range(1, cap + 1) if a > 0 and a ** k >= threshold - 1e-12],
                        default=0) for a in accs]
            assert _largest_ks(accs, logs, [cap] * len(accs), threshold) == want, (threshold, cap)


def test_the_probe_drafts_one_token_after_probe_every_idle_steps_and_again_once_on_time():
    """`DraftProbe`: after PROBE_EVERY steps without drafting, the speculative sequence whose draft
    is least behind drafts one token; the next step one whose draft is on time (catch-up <=
    CATCH_UP_MAX) drafts one token again, the step the engine calibrates on. While probes do not
    restart drafting the wait doubles, up to PROBE_EVERY_MAX; drafting by choice resets it."""
    from engine.calibration import CATCH_UP_MAX
    from engine.k_rule import PROBE_EVERY, PROBE_EVERY_MAX, DraftProbe

    def idle_until_probe(probe, caps, behind):
        steps = 0
        while True:
            steps += 1
            ks = probe([0] * len(caps), caps, behind)
            if any(ks):
                return steps, ks

    probe = DraftProbe()
    caps, behind = [0, 4, 4, 4], [0, 70, 30, 50]
    assert idle_until_probe(probe, caps, behind) == (PROBE_EVERY, [0, 0, 1, 0])   # least behind
    assert probe([0] * 4, caps, [0, 9, CATCH_UP_MAX, 9]) == [0, 0, 1, 0]            # measured
    assert probe([0] * 4, caps, [0, 1, 1, 1]) == [0] * 4                            # once
    waits = [idle_until_probe(probe, caps, behind)[0] for _ in range(6)]
    waits[0] += 2                                   # the two steps above count
    assert waits == [2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY] + [PROBE_EVERY_MAX] * 3
    assert PROBE_EVERY_MAX == 16 * PROBE_EVERY
    assert probe([0, 2, 2, 2], caps, behind) == [0, 2, 2, 2]                        # by choice
    assert idle_until_probe(probe, caps, None) == (PROBE_EVERY, [0, 1, 0, 0])
    assert probe([0] * 4, caps, [0, CATCH_UP_MAX + 1, 0, 0]) == [0, 0, 1, 0]         # on time
    nobody = DraftProbe()
    assert all(nobody([0, 0], [0, 0], None) == [0, 0] for _ in range(3 * PROBE_EVERY))


def test_an_engine_that_stopped_drafting_probes_and_learns_the_drafts_price(make_engine):
    """The engine's price for the draft moves only with drafting steps, and an over-priced draft
    stops drafting: without a probe the engine would never learn the price back. Its probe's
    second step is a calibrated decode step, so a draft priced at 1 s a round (it takes well
    under a millisecond) is learnt as cheap as CAL_SCALE_RANGE allows."""
    from engine.calibration import CAL_SCALE_RANGE, CalibratedCost
    from engine.k_rule import PROBE_EVERY
    from engine.sampling_params import RequestOptions, SamplingParams

    engine = make_engine(adaptive_k=True)
    engine.cost = CalibratedCost(LinearStepCost(LinearCost(1e-3, 0.0, 0.0), LinearCost(1.0, 0.0, 0.0)),
                                 draft_excess=True)
    drafted = []
    calibrate = engine.cost.calibrate

    def record(ks, ctx, secs, **kw):
        drafted.append(any(ks))
        calibrate(ks, ctx, secs, **kw)

    engine.cost.calibrate = record
    params = SamplingParams(temperature=0, max_tokens=PROBE_EVERY + 8, ignore_eos=True)
    engine.add_request("r", list(range(5, 25)), params, RequestOptions("speculative", k_max=3))
    while engine.has_unfinished():
        engine.step()
    assert drafted.count(True) == 1 and len(drafted) > PROBE_EVERY
    assert engine.cost.spec_scale == pytest.approx(CAL_SCALE_RANGE[0])


def test_a_long_catch_up_is_priced_as_the_round_that_feeds_it():
    """A draft that must first feed a 1,200-token prompt, on a table whose first tokens a
    sequence cost nearly nothing (bound by reading weights) and whose later ones cost compute:
    the catch-up is priced at what those tokens add to the draft's round, and a sequence with
    eight tokens left does not draft. Red when it is priced at the cost of one more token a
    sequence (the flat part of the table: 1,200 of them looked nearly free)."""
    from engine.k_rule import catch_up_prices, engine_choose_k
    from engine.step_cost import TableCost, TableStepCost

    def table(flat_s, per_token_s):
        return TableCost({n: [(1.0, flat_s), (2.0, flat_s * 1.01), (8.0, flat_s + 6 * n * per_token_s)]
                          for n in (1, 2, 4, 8, 16)})
    cost = TableStepCost(table(0.010, 0.0008), table(0.002, 0.0002))
    b, prompt = 4, 1200
    prices = catch_up_prices(cost, [0.8] * b, [prompt] * b, [8] * b, 0)
    fed = cost.draft_s(b, b + prompt) - cost.draft_s(b, b)
    assert prices == pytest.approx([fed / (8 / 1.8)] * b)
    assert prices[0] > 0.05           # a tenth of a second, not the flat part's 1 ms
    assert engine_choose_k([0.8] * b, [4] * b, cost, 0, 0, prices) == [0] * b
    on_time = catch_up_prices(cost, [0.8] * b, [2] * b, [400] * b, 0)
    assert all(engine_choose_k([0.8] * b, [4] * b, cost, 0, 0, on_time))
