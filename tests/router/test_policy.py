"""router.policy.choose_tier: every reason reachable, no load gate for auto, opt-ins honoured."""

from dataclasses import replace

import pytest

from engine.step_cost import LinearCost, LinearStepCost
from engine.hardware import GPUS, MODELS, GiB, RooflineStepCost
from router.policy import (PLANS, REASONS, Decision, PolicyConfig, PolicyState, TierRequest, choose_tier,
                           classify_prompt, speculation_gain)
from router.stats import ClusterStats, TierStats

SHARDED = RooflineStepCost(GPUS["A100-80GB"], MODELS["Llama-2-70B"], MODELS["Llama-2-7B"], tp=4, draft_tp=4)
LINEAR = LinearStepCost(LinearCost(20e-3, 0.0, 2e-4), LinearCost(2e-3, 0.0, 1e-6))  # verify tokens dear


def target(**kw) -> TierStats:
    base = dict(decode_batch_size=0, kv_headroom_bytes=40 * GiB, kv_budget_bytes=40 * GiB,
                target_kv_bytes_per_token=81920.0, draft_kv_bytes_per_token=131072.0,
                acceptance_by_class={"chat": 0.6, "code": 0.7},
                mean_output_tokens=300, cost=SHARDED)
    return TierStats(**{**base, **kw})


def cluster(small_queue: int | None = 0, small_up: bool = True, small_cold: bool = False,
            **kw) -> ClusterStats:
    t = target(**kw)
    tiers = {"speculative": t, "baseline": t}
    if small_queue is not None:
        tiers["small"] = TierStats(queue_depth=small_queue, available=small_up and not small_cold,
                                   cold=small_cold)
    return ClusterStats(tiers)


def req(**kw) -> TierRequest:
    return TierRequest(**{**dict(prompt_tokens=500, max_tokens=512), **kw})


STATE = PolicyState()

# (request, stats, state, tier, reason)
TABLE = [
    (req(speculation="off"), cluster(), STATE, "baseline", "speculation_off"),
    (req(plan="premium", speculation="off"), cluster(), STATE, "baseline", "speculation_off"),
    (req(plan="economy"), cluster(), STATE, "small", "plan_economy"),
    (req(plan="premium"), cluster(decode_batch_size=63), STATE, "speculative", "plan_premium"),
    (req(plan="standard", speculation="on"), cluster(), STATE, "speculative", "speculation_on"),
    (req(plan="premium"), cluster(kv_headroom_bytes=1 * GiB), STATE, "baseline", "kv_headroom"),
    (req(), cluster(cost=None), STATE, "baseline", "no_draft"),
    (req(), cluster(draft_kv_bytes_per_token=0.0), STATE, "baseline", "no_draft"),
    (req(), cluster(kv_headroom_bytes=4 * GiB), STATE, "baseline", "kv_headroom"),
    # a deep queue diverts only callers who allow the small tier; auto stays on its own rule
    (req(), cluster(queue_depth=20), STATE, "speculative", "speculation_pays"),
    (req(plan="standard"), cluster(queue_depth=20), STATE, "baseline", "plan_standard"),
    (req(allow_downgrade=True), cluster(queue_depth=20), STATE, "small", "queue_deep"),
    (req(allow_downgrade=True), cluster(small_queue=None, queue_depth=20), STATE,
     "speculative", "speculation_pays"),
    (req(plan="standard"), cluster(), STATE, "baseline", "plan_standard"),
    # the engine measured drafting losing at its live acceptance: auto follows, premium keeps it
    (req(), cluster(drafting_loses=True), STATE, "baseline", "drafting_loses"),
    (req(plan="premium"), cluster(drafting_loses=True), STATE, "speculative", "plan_premium"),
    (req(prompt_class="creative"), cluster(acceptance_by_class={"creative": 0.03}), STATE,
     "baseline", "acceptance_low"),
    (req(prompt_class="creative", probe=True), cluster(acceptance_by_class={"creative": 0.03}),
     STATE, "speculative", "acceptance_probe"),
    (req(probe=True), cluster(drafting_loses=True), STATE, "speculative", "drafting_probe"),
    (req(), cluster(decode_batch_size=200, context_tokens=200 * 800,
                    acceptance_samples=tuple(i / 100 for i in range(5, 95))), STATE,
     "speculative", "speculation_pays"),
    (req(), cluster(), STATE, "speculative", "speculation_pays"),
    (req(), cluster(decode_batch_size=8, num_speculating=8, context_tokens=8 * 800), STATE,
     "speculative", "speculation_pays"),
    # a tier down: around it where the caller's plan allows, else to it (its replica answers
    # 503 with the expected recovery as Retry-After)
    (req(plan="economy"), cluster(small_up=False), STATE, "baseline", "tier_down"),
    (req(plan="economy"), cluster(small_up=False, available=False), STATE, "small",
     "plan_economy"),
    (req(allow_downgrade=True), cluster(available=False), STATE, "small", "tier_down"),
    (req(plan="premium", allow_downgrade=True), cluster(available=False), STATE, "small",
     "tier_down"),
    (req(allow_downgrade=True), cluster(available=False, small_up=False), STATE, "speculative",
     "speculation_pays"),
    (req(), cluster(available=False), STATE, "speculative", "speculation_pays"),
    (req(plan="standard"), cluster(available=False), STATE, "baseline", "plan_standard"),
    (req(allow_downgrade=True), cluster(small_queue=None, available=False), STATE,
     "speculative", "speculation_pays"),
    # the small tier scaled to zero: economy to baseline (the ingress wakes the tier); a deep
    # queue or a target down sends no one to wait on its cold start
    (req(plan="economy"), cluster(small_cold=True), STATE, "baseline", "small_cold"),
    (req(allow_downgrade=True), cluster(small_cold=True, queue_depth=20), STATE,
     "speculative", "speculation_pays"),
    (req(allow_downgrade=True), cluster(small_up=False, queue_depth=20), STATE,
     "speculative", "speculation_pays"),
    (req(allow_downgrade=True), cluster(small_cold=True, available=False), STATE,
     "speculative", "speculation_pays"),
]


@pytest.mark.parametrize("request_, stats, state, tier, reason", TABLE)
def test_table(request_, stats, state, tier, reason):
    d = choose_tier(request_, stats, state)
    assert (d.tier, d.reason) == (tier, reason)
    assert d.k_max == (PolicyConfig().k_max if tier == "speculative" else 0)


def test_every_reason_is_reachable():
    assert {row[4] for row in TABLE} == set(REASONS)


def test_auto_speculates_at_any_batch_where_its_class_pays():
    """No load gate: where the predicted gain of the whole batch speculating falls to 1
    (verification dear, a large batch), auto still sends a request whose class pays alone to
    the speculative tier, where the engine's adaptive k decides each step whether to draft.
    A batch-level gate would send such requests to baseline where the engine's k still gains
    (docs/decisions/0017-tier-policy.md)."""
    swept = 0
    for b in range(0, 300, 10):
        s = cluster(cost=LINEAR, decode_batch_size=b, context_tokens=b * 500)
        batch_gain = speculation_gain(s.target, 0.6, 8, 500, 512)
        alone = speculation_gain(s.target, 0.6, 8, 500, 512, alone=True)
        d = choose_tier(req(), s, PolicyState())
        assert alone >= PolicyConfig().min_gain
        assert (d.tier, d.reason, d.k_max) == ("speculative", "speculation_pays", PolicyConfig().k_max)
        swept += batch_gain < 1.02          # where a batch-level gate would stop speculating
    assert swept, "no batch in the sweep where the batch's predicted gain is below 1.02"
    # what is per request stays: a class whose drafts do not pay even alone goes to baseline
    s = cluster(cost=LINEAR, acceptance_by_class={"chat": 0.05})
    assert choose_tier(req(), s, PolicyState()).reason == "acceptance_low"
    assert choose_tier(req(), s, PolicyState(), PolicyConfig(min_gain=0.5)).reason == "speculation_pays"


def test_a_probe_speculates_where_the_class_is_judged_low_and_nowhere_else():
    """A class's acceptance is learnt from speculative requests alone: without probes, a class
    once judged low would go to baseline for good, its estimate never updated after the draft
    or the traffic changed (and the alignment loop, which distils the low classes, would see
    none of it). A probe speculates exactly where acceptance_low would send it to baseline;
    every other rule holds for it."""
    low = cluster(cost=LINEAR, acceptance_by_class={"chat": 0.05})
    d = choose_tier(req(probe=True), low, PolicyState())
    assert (d.tier, d.reason, d.k_max) == ("speculative", "acceptance_probe", PolicyConfig().k_max)
    assert choose_tier(req(probe=False), low, PolicyState()).reason == "acceptance_low"
    for kw, reason in ((dict(plan="standard"), "plan_standard"),
                       (dict(speculation="off"), "speculation_off"),
                       (dict(plan="economy"), "plan_economy")):
        assert choose_tier(req(probe=True, **kw), low, PolicyState()).reason == reason
    paying = cluster(cost=LINEAR)
    assert choose_tier(req(probe=True), paying, PolicyState()).reason == "speculation_pays"
    # the engine's verdict that drafting loses is re-judged only where some sequence drafts
    loses = cluster(cost=LINEAR, drafting_loses=True)
    d = choose_tier(req(probe=True), loses, PolicyState())
    assert (d.tier, d.reason) == ("speculative", "drafting_probe")
    assert choose_tier(req(), loses, PolicyState()).reason == "drafting_loses"
    with pytest.raises(ValueError, match="probe_share"):
        PolicyConfig(probe_share=1.5)


def test_a_draft_price_learnt_under_load_does_not_lock_auto_out():
    """Auto's per-request test prices drafting at the replica's profile, not at the price the
    replica learnt under load (`CalibratedCost.spec_scale`). Priced with a learnt 4x, a lone
    request looks unpaying, every auto request goes to baseline as `acceptance_low`, nothing
    drafts, and the price is never measured again (docs/decisions/0017-tier-policy.md). A
    draft whose acceptance does not pay on the profile still goes to baseline."""
    from engine.calibration import CalibratedCost

    base = LinearStepCost(LinearCost(4e-3, 1e-5, 1e-7), LinearCost(1e-3, 1e-6, 1e-8))
    dear = CalibratedCost(base, 1e-4, spec_scale=4.0)
    loaded = cluster(cost=dear, decode_batch_size=16, context_tokens=16 * 600)
    assert speculation_gain(loaded.target, 0.6, 8, 500, 512, alone=True) < PolicyConfig().min_gain
    d = choose_tier(req(), loaded, PolicyState())
    assert (d.tier, d.reason) == ("speculative", "speculation_pays")
    weak = cluster(cost=dear, acceptance_by_class={"chat": 0.05})
    assert choose_tier(req(), weak, PolicyState()).reason == "acceptance_low"


def test_queue_deep_hysteresis():
    cfg = PolicyConfig()
    between = cluster(queue_depth=cfg.queue_deep_exit + 1)
    down = req(allow_downgrade=True)
    assert choose_tier(down, between, PolicyState(queue_deep=True)).reason == "queue_deep"
    assert choose_tier(down, between, PolicyState(queue_deep=False)).reason != "queue_deep"
    assert not choose_tier(down, cluster(), PolicyState(queue_deep=True)).state.queue_deep
    assert choose_tier(req(), between, PolicyState(queue_deep=True)).state.queue_deep


ALL_STATS = [row[1] for row in TABLE]
ALL_STATES = [PolicyState(), PolicyState(queue_deep=True)]


@pytest.mark.parametrize("plan", PLANS)
def test_speculation_off_is_always_honoured(plan):
    for stats in ALL_STATS:
        for state in ALL_STATES:
            for downgrade in (False, True):
                d = choose_tier(req(plan=plan, speculation="off", allow_downgrade=downgrade), stats, state)
                # Never speculative; an economy caller keeps the cheaper small tier (unless a
                # tier is down or cold: then the other non-speculative one).
                assert d.tier != "speculative" and d.k_max == 0
                if d.reason not in ("tier_down", "small_cold"):
                    assert d.tier == ("small" if plan == "economy" else "baseline")


@pytest.mark.parametrize("plan", ["premium", "standard", "auto"])
def test_no_downgrade_to_small_without_opt_in(plan):
    for stats in ALL_STATS + [cluster(queue_depth=10_000)]:
        for state in ALL_STATES:
            for speculation in ("auto", "on"):
                d = choose_tier(req(plan=plan, speculation=speculation), stats, state)
                assert d.tier != "small"


def test_pure_and_state_explicit():
    stats, state = cluster(), PolicyState()
    first, second = choose_tier(req(), stats, state), choose_tier(req(), stats, state)
    assert first == second and isinstance(first, Decision)
    assert state == PolicyState()  # the caller's state is not mutated
    with pytest.raises(Exception):
        state.queue_deep = True  # frozen


@pytest.mark.parametrize("bad", [dict(plan="gold"), dict(speculation="maybe"), dict(max_tokens=0),
                                 dict(prompt_tokens=-1)])
def test_request_validation(bad):
    with pytest.raises(ValueError):
        TierRequest(**bad)


def test_stats_validation():
    with pytest.raises(ValueError):
        TierStats(decode_batch_size=2, num_speculating=3)
    with pytest.raises(KeyError):
        ClusterStats({"small": TierStats()}).target


@pytest.mark.parametrize("text,cls", [
    ("def f(x):\n    return x + 1", "code"), ("```python\nprint(1)\n```", "code"),
    ("Write a short story about a lighthouse keeper", "creative"), ("a haiku on autumn please", "creative"),
    ("What is the capital of Australia?", "qa"), ("how do vaccines work", "qa"),
    ("Thanks, that helped a lot. Let's continue tomorrow.", "chat"),
])
def test_classify_prompt(text, cls):
    assert classify_prompt(text) == cls


def test_whole_draft_stops_paying_sooner():
    whole = replace(SHARDED, draft_tp=1)
    samples = tuple(i / 100 for i in range(20, 90))
    for b in (16, 32):
        s_sharded = target(decode_batch_size=b, context_tokens=b * 800, acceptance_samples=samples)
        s_whole = replace(s_sharded, cost=whole)
        assert speculation_gain(s_whole, 0.6, 8, 500) < speculation_gain(s_sharded, 0.6, 8, 500)


def test_the_gain_is_predicted_with_the_engines_own_k():
    """`speculation_gain` prices the batch at the k the engine will pick (`engine_choose_k`:
    no p95 slowdown guard). With the guard, the batch's lowest expected acceptance (here 0.05,
    the 1/(B+1) quantile of the samples) vetoed every draft token from batch 16 on, so auto sent
    requests to baseline (`batch_large`) where the engine, speculating, drafts 1-2 tokens a
    sequence and gains 11-19% (seed-4xa100, draft sharded: 6-9% lost at 32-40 users)."""
    from engine.k_rule import choose_k, engine_choose_k

    samples = tuple(i / 100 for i in range(5, 95))
    for b in (16, 32):
        s = cluster(decode_batch_size=b, context_tokens=b * 800, acceptance_samples=samples)
        acc = [0.6] + [samples[len(samples) // 2]] * (b - 1) + [samples[len(samples) // (b + 1)]]
        ctx = 500 + s.target.context_tokens
        assert not any(choose_k(acc, [8] * (b + 1), SHARDED, ctx))          # the guard's veto
        assert all(engine_choose_k(acc, [8] * (b + 1), SHARDED, ctx, 0))     # the engine drafts
        assert speculation_gain(s.target, 0.6, 8, 500, 512) > 1.10
