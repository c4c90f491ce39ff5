"""engine.cost_model and engine.hardware: hand-counted bytes, the roofline, and choose_k."""

import json
import math
import random
import subprocess
import sys

import pytest

from engine.cost_model import LinearCost, LinearStepCost, choose_k, expected_tokens, step_s
from engine.hardware import GPUS, MODELS, RooflineStepCost


def test_import_is_pure_python():
    code = ("import sys, engine.cost_model, engine.hardware, router.policy, router.stats; "
            "print(any(m in sys.modules for m in ('torch', 'ray', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("a,k,want", [(0.5, 0, 1.0), (0.5, 2, 1.75), (0.0, 4, 1.0), (1.0, 4, 5.0),
                                      (0.999999999999, 3, 4.0), (0.58, 4, (1 - 0.58**5) / 0.42)])
def test_expected_tokens(a, k, want):
    assert expected_tokens(a, k) == pytest.approx(want)


# Hand counts from the published configs: per layer q,k,v,o + gate,up,down + 2 norms; embeddings,
# LM head (unless tied), final norm.
def _hand_params(layers, h, heads, kv_heads, inter, vocab, tied=False, head_dim=None):
    hd = head_dim or h // heads
    per_layer = h * heads * hd * 2 + 2 * h * kv_heads * hd + 3 * h * inter + 2 * h
    return layers * per_layer + vocab * h * (1 if tied else 2) + h


@pytest.mark.parametrize("name,params,kv_bytes", [
    ("Llama-2-70B", _hand_params(80, 8192, 64, 8, 28672, 32000), 2 * 80 * 8 * 128 * 2),
    ("Llama-2-7B", _hand_params(32, 4096, 32, 32, 11008, 32000), 2 * 32 * 32 * 128 * 2),
    ("Llama-3-8B", _hand_params(32, 4096, 32, 8, 14336, 128256), 2 * 32 * 8 * 128 * 2),
    ("Llama-3.2-1B", _hand_params(16, 2048, 32, 8, 8192, 128256, tied=True, head_dim=64),
     2 * 16 * 8 * 64 * 2),
])
def test_model_bytes_match_hand_counts(name, params, kv_bytes):
    m = MODELS[name]
    assert m.param_count() == params
    assert m.weight_bytes(2) == 2 * params
    assert m.kv_bytes_per_token(2) == kv_bytes


def test_published_sizes():
    assert MODELS["Llama-2-70B"].kv_bytes_per_token() == 327_680  # the hand count
    assert MODELS["Llama-2-70B"].param_count() == 68_976_648_192
    assert MODELS["Llama-2-7B"].param_count() == 6_738_415_616
    assert MODELS["Llama-3-8B"].param_count() == 8_030_261_248
    assert MODELS["Llama-3.2-1B"].param_count() == 1_235_814_400


def test_calibrated_cost_adds_what_the_engine_learnt_and_round_trips():
    from engine.cost_model import CalibratedCost, step_cost_from_dict

    base = LinearStepCost(LinearCost(1e-2, 2e-4, 5e-4), LinearCost(1e-3, 1e-5, 2e-5))
    cost = CalibratedCost(base, per_seq_s=3e-3)
    assert cost.target_s(4, 8) == pytest.approx(base.target_s(4, 8) + 4 * 3e-3)
    assert cost.draft_s(4, 4) == base.draft_s(4, 4)
    assert step_cost_from_dict(json.loads(json.dumps(cost.to_dict()))) == cost


def test_linear_step_cost_round_trips_as_json():
    cost = LinearStepCost(LinearCost(1e-2, 2e-4, 5e-4, 1e-7), LinearCost(1e-3, 1e-5, 2e-5))
    again = LinearStepCost.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert again == cost
    assert again.target_s(4, 8, 100) == pytest.approx(1e-2 + 8e-4 + 4e-3 + 1e-5)


A100, L70, L7 = GPUS["A100-80GB"], MODELS["Llama-2-70B"], MODELS["Llama-2-7B"]


def test_roofline_memory_bound_at_batch_one():
    cost = RooflineStepCost(A100, L70, L7, tp=4, draft_tp=4, overhead_s=0.0, draft_overhead_s=0.0)
    weights_s = L70.matmul_params() * 2 / 4 / A100.mem_bw
    allreduce_s = 2 * 80 * A100.allreduce_latency_s
    assert cost.target_s(1, 1) == pytest.approx(weights_s + allreduce_s, rel=0.01)
    # compute-bound for a long prefill: FLOPs over the matmul rate, plus ring all-reduces of
    # [8192, 8192] bf16 activations, 2 per layer, moving 2 (tp - 1) / tp of the bytes each
    flops_s = 8192 * 2 * L70.matmul_params() / 4 / A100.flops
    ring_s = 2 * 80 * (A100.allreduce_latency_s + 8192 * 8192 * 2 * 1.5 / A100.link_Bps)
    assert cost.target_s(1, 8192) == pytest.approx(flops_s + ring_s, rel=0.02)
    assert cost.target_s(64, 64) < 1.2 * cost.target_s(1, 1)  # decode batch stays memory-bound


def test_draft_placement_changes_the_cost_ratio():
    sharded = RooflineStepCost(A100, L70, L7, tp=4, draft_tp=4)
    whole = RooflineStepCost(A100, L70, L7, tp=4, draft_tp=1)
    c_sharded = sharded.draft_s(1, 1) / sharded.target_s(1, 1)
    c_whole = whole.draft_s(1, 1) / whole.target_s(1, 1)
    assert 0.08 < c_sharded < 0.2 and 0.25 < c_whole < 0.45
    assert c_whole / c_sharded > 2  # 4x the weight bytes per GPU, less after fixed costs
    with pytest.raises(ValueError):
        RooflineStepCost(A100, L70).draft_s(1, 1)


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


def test_without_flags_calibration_learns_only_the_overhead():
    """CalibratedCost(base) moves per_seq_s by an EWMA of the residual and never rescales
    drafting."""
    from engine.cost_model import OVERHEAD_EWMA, CalibratedCost, LinearCost, LinearStepCost, step_s

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
    from engine.cost_model import CalibratedCost, LinearCost, LinearStepCost, step_s

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
    from engine.cost_model import CAL_SCALE_RANGE, CalibratedCost, LinearCost, LinearStepCost

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
    from engine.cost_model import CalibratedCost, LinearCost, LinearStepCost, step_s

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
    from engine.cost_model import CalibratedCost, LinearCost, LinearStepCost, step_s

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
    from engine.cost_model import CalibratedCost, LinearCost, LinearStepCost, step_s

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
    from engine.cost_model import CalibratedCost

    engine = make_engine(adaptive_k=True)
    engine.cost = CalibratedCost(LINEAR)
    return engine


def test_the_engine_spreads_a_catch_up_over_the_steps_the_sequence_has_left(make_engine):
    """The same catch-up is worth paying for a sequence with many tokens left and not for one
    about to finish (a straggler whose catch-up is spread over a fixed few steps lags further
    every step and never drafts again, even alone: docs/decisions/0009-k-rule.md)."""
    from engine.cost_model import PAYBACK_STEPS

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
    from engine.cost_model import MIN_GAIN

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
    from engine.cost_model import MIN_GAIN, MIN_GAIN_ALONE

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
    from engine.cost_model import _largest_ks

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
    from engine.cost_model import CATCH_UP_MAX, PROBE_EVERY, PROBE_EVERY_MAX, DraftProbe

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
    from engine.cost_model import CAL_SCALE_RANGE, CalibratedCost, LinearCost, LinearStepCost, PROBE_EVERY
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
