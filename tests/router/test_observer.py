"""router.observer: EngineStats and finished requests in, ClusterStats out, for the live router
and the simulator alike (one path from the engine to choose_tier)."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from cluster.sim import simulator
from cluster.sim.replica import build_replicas
from cluster.sim.scenarios import MIXES, SCENARIOS
from engine.calibration import CalibratedCost
from engine.outputs import EngineStats
from engine.step_cost import LinearCost, LinearStepCost
from router import live_stats
from router.observer import Observer, RequestOutcome
from router.policy import PolicyConfig, PolicyState, TierRequest, choose_tier

COST = CalibratedCost(LinearStepCost(LinearCost(1e-3, 1e-5, 1e-6), LinearCost(1e-4, 1e-6, 1e-7)), 2e-4)


def engine_stats(**kw) -> EngineStats:
    base = dict(num_running=0, num_waiting=0, num_speculative=0, kv_budget_bytes=1000,
                kv_used_target_bytes=0, kv_used_draft_bytes=0, target_kv_bytes_per_token=10.0,
                draft_kv_bytes_per_token=2.0, context_tokens=0, max_model_len=512, cost=COST,
                time=1.0)
    return EngineStats(**{**base, **kw})


def test_engine_stats_become_policy_stats():
    busy = engine_stats(num_running=3, num_waiting=2, num_speculative=1, kv_used_target_bytes=400,
                        kv_used_draft_bytes=100, context_tokens=40, acceptance_rate=0.5,
                        token_acceptance=0.8, speculating_acceptance=(0.75,))
    idle = engine_stats()
    obs = Observer()
    obs.report("a", busy)
    obs.report("b", idle)
    obs.queued("target", 1)
    assert obs.next_replica("target") is idle
    stats = obs.cluster_stats()
    target = stats.target
    assert target.decode_batch_size == 0 and target.queue_depth == 1
    assert target.kv_headroom_bytes == 1000 and target.can_speculate
    assert target.cost is COST               # the calibrated cost, what the engine learnt included
    assert stats.small.decode_batch_size == 0
    obs.retain("target", ["a"])
    obs.queued("target", 0)
    target = obs.cluster_stats().target
    assert target.decode_batch_size == 3 and target.queue_depth == 2
    assert target.kv_headroom_bytes == 500 and target.context_tokens == 40
    assert target.speculating_acceptance == (0.75,)
    assert target.acceptance_by_class["chat"] == 0.8      # the per-token a, not accepted/drafted
    obs.finished("speculative", "code", RequestOutcome(12, 30, accepted_tokens=9, draft_trials=20))
    obs.finished("small", "code", RequestOutcome(100, 100))
    target = obs.cluster_stats().target
    assert target.acceptance_samples == (9 / 20,) and target.mean_output_tokens == 30.0
    assert 0.45 < target.acceptance_by_class["code"] < 0.8    # moved from the prior toward 9/20
    assert obs.draft_swapped() == ["code"] and obs.cluster_stats().target.acceptance_samples == ()


def test_a_replica_that_measured_drafting_losing_tells_the_policy():
    """`EngineStats.drafting_pays` False (engine/goodput.py) becomes `drafting_loses`; True and
    None (not judged yet) do not."""
    for pays, loses in ((False, True), (True, False), (None, False)):
        obs = Observer()
        obs.report("a", engine_stats(drafting_pays=pays))
        assert obs.cluster_stats().target.drafting_loses is loses


def test_small_tier_never_speculates_and_a_dead_replica_goes_last():
    obs = Observer()
    obs.report("s", engine_stats(draft_kv_bytes_per_token=5.0), "small")
    assert not obs.cluster_stats().small.can_speculate
    obs.report("dead", engine_stats(available=False))
    obs.report("busy", engine_stats(num_running=9))
    assert obs.next_replica("target").num_running == 9


def test_a_replica_that_answered_its_engine_is_down_is_routed_last_until_it_serves_again(
        monkeypatch):
    """Its stats still say available (they lag a period) and its queue is as empty as the
    live one's, a tie Serve breaks by order: the caller's mark puts it last until stats taken
    after the mark arrive, or the mark is old."""
    monkeypatch.setattr(live_stats, "_DOWN", {})
    t0 = time.time()

    def replica(rid, **kw):
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid),
                               routing_stats=engine_stats(time=t0, **kw))

    a, b = replica("a"), replica("b")
    assert live_stats.replica_groups([a, b]) == [[a, b]]
    live_stats.mark_down("a", now=t0 + 0.5)
    assert live_stats.replica_groups([a, b]) == [[b], [a]]
    assert live_stats.replica_groups([a]) == [[a]]          # alone, it is still tried
    a.routing_stats = engine_stats(time=t0 + 0.2)               # stats from before the answer
    assert live_stats.replica_groups([a, b]) == [[b], [a]]
    a.routing_stats = engine_stats(time=t0 + 1, available=False)
    assert live_stats.replica_groups([a, b]) == [[b], [a]]
    a.routing_stats = engine_stats(time=t0 + 1)                 # serves again, said after the mark
    assert live_stats.replica_groups([a, b]) == [[a, b]] and live_stats._DOWN == {}
    live_stats.mark_down("b", now=time.time() - live_stats.DOWN_FORGET_S - 1)
    assert live_stats.replica_groups([a, b]) == [[a, b]]    # an old mark is forgotten
    live_stats.mark_down("gone", now=t0 - live_stats.DOWN_FORGET_S - 1)
    live_stats.mark_down("a", now=t0 + 3)                   # and never kept for a gone replica
    assert set(live_stats._DOWN) == {"a"}


class _Recorder(Observer):
    """The simulator's observer, recording what it is told, in order."""

    log: list = []

    def report(self, replica_id, stats, kind="target"):
        self.log.append(("report", replica_id, stats, kind))
        super().report(replica_id, stats, kind)

    def finished(self, tier, prompt_class, outcome):
        self.log.append(("finished", tier, prompt_class, outcome))
        super().finished(tier, prompt_class, outcome)


def _simulate_and_record(monkeypatch, load: int, seed: int):
    """Run the simulator's auto policy; return its observer's inputs and its decisions."""
    events = []
    _Recorder.log = events
    real = simulator.choose_tier

    def deciding(request, stats, state, config):
        decision = real(request, stats, state, config)
        events.append(("decide", request, stats, state, decision))
        return decision

    monkeypatch.setattr(simulator, "Observer", _Recorder)
    monkeypatch.setattr(simulator, "choose_tier", deciding)
    scn = SCENARIOS["seed-4xa100"]
    target, small = build_replicas(scn.deployment, "whole", "auto", 4)
    workload = replace(scn.workload, requests=48)
    simulator.simulate(target, small, "auto", workload, MIXES["article"], load, seed=seed)
    return events


# A load and workload seed where auto decides for both of its reasons in the simulation, so
# that the live path is checked on each kind of decision.
@pytest.mark.parametrize("load,seed,reasons", [(4, 3, {"speculation_pays", "acceptance_low"})])
def test_the_live_router_decides_as_the_simulator_on_the_same_engine_stats(monkeypatch, load, seed,
                                                                           reasons):
    events = _simulate_and_record(monkeypatch, load, seed)
    assert {e[4].reason for e in events if e[0] == "decide"} == reasons
    assert any(e[0] == "finished" and e[1] == "speculative" for e in events)

    # The live side: Serve's routers hold each replica's last EngineStats; LiveStats polls them.
    routers = {kind: SimpleNamespace(stats={}, num_queued=0) for kind in ("target", "small")}
    for kind, r in routers.items():
        r.replica_stats = (lambda r=r: dict(r.stats))
    handles = {kind: SimpleNamespace(deployment_id=SimpleNamespace(app_name="sim", name=kind))
               for kind in routers}
    monkeypatch.setattr(live_stats, "_ROUTERS", {("sim", k): r for k, r in routers.items()})
    observer = Observer(PolicyConfig().default_acceptance, tuple(handles))
    live = live_stats.LiveStats(handles, observer)
    state = PolicyState()
    for event in events:
        if event[0] == "report":
            _, replica_id, stats, kind = event
            routers[kind].stats[replica_id] = stats
            live.poll(now=stats.time)
        elif event[0] == "finished":
            observer.finished(*event[1:])
        else:
            _, request, sim_stats, sim_state, sim_decision = event
            assert state == sim_state
            stats = observer.cluster_stats()
            assert stats == sim_stats
            decision = choose_tier(request, stats, state, PolicyConfig())
            assert decision == sim_decision
            state = decision.state


def test_health_shows_what_the_replicas_learnt_beyond_their_profile():
    """`/health` reports the replicas' learnt per-sequence overhead and draft price factor
    (their mean), which `bench serve` records for `simulate --scenario local-cpu`."""
    obs = Observer()
    obs.report("a", engine_stats(cost=CalibratedCost(COST.base, per_seq_s=2e-4, spec_scale=1.0)))
    obs.report("b", engine_stats(cost=CalibratedCost(COST.base, per_seq_s=4e-4, spec_scale=1.5)))
    target = obs.health()["target"]
    assert target["cost_per_seq_ms"] == pytest.approx(0.3)
    assert target["cost_spec_scale"] == pytest.approx(1.25)
    assert obs.health()["small"]["cost_per_seq_ms"] is None      # no replica reported yet


def test_the_policy_sees_the_draft_price_at_its_recent_median():
    """The draft's price factor the engine learns swings within seconds under serving, at
    steady acceptance (docs/decisions/0017-tier-policy.md): the cluster's view takes its recent
    median, so one spike does not move it; a change that lasts does; a replica that left is
    forgotten. Auto's per-request test prices drafting at the profile (`router/policy.py`), so
    neither sends its requests to baseline: a dear draft is the engine's to act on, step by
    step."""
    cost = CalibratedCost(LinearStepCost(LinearCost(1e-3, 1e-5, 1e-6), LinearCost(3e-4, 1e-6, 1e-7)),
                          2e-4)

    def stats(scale: float, t: float) -> EngineStats:
        return engine_stats(cost=replace(cost, spec_scale=scale), token_acceptance=0.7,
                            kv_budget_bytes=10**9, time=t)

    def decide(obs: Observer) -> str:
        return choose_tier(TierRequest(), obs.cluster_stats(), PolicyState()).reason

    obs = Observer()
    for t in range(60):
        obs.report("a", stats(1.2, float(t)))
    assert decide(obs) == "speculation_pays"
    obs.report("a", stats(3.5, 60.0))                   # one spike: speculating still pays
    for _ in range(40):                                 # the poller re-reads the same report
        obs.report("a", stats(3.5, 60.0))
    assert obs.cluster_stats().target.cost.spec_scale == 1.2
    assert decide(obs) == "speculation_pays"
    assert obs.health()["target"]["cost_spec_scale"] == 3.5     # /health: what the replica has now
    for t in range(61, 96):                             # the draft stays dear for 35 s: the
        obs.report("a", stats(3.5, float(t)))           # price follows (the minute before ages out)
    assert obs.cluster_stats().target.cost.spec_scale == 3.5
    assert decide(obs) == "speculation_pays"
    for t in range(96, 140):                            # cheap again
        obs.report("a", stats(1.2, float(t)))
    assert obs.cluster_stats().target.cost.spec_scale == 1.2
    obs.retain("target", [])
    obs.report("a", stats(3.5, 150.0))                  # back after leaving: its new price only
    assert obs.cluster_stats().target.cost.spec_scale == 3.5
    # Before Serve's first stats broadcast every tier reports as "ready": one tier's prices
    # never enter another's.
    obs = Observer()
    obs.report("ready", stats(1.2, 1.0), "target")
    obs.report("ready", stats(3.5, 2.0), "small")
    obs.report("ready", stats(3.5, 3.0), "small")
    assert obs.cluster_stats().target.cost.spec_scale == 1.2


def test_health_sums_where_serving_time_goes_and_shows_the_profile_on_request():
    """`/health` sums the replicas' cumulative `ServingTimes` (what `bench serve` takes window
    differences of) and, asked (`?profile=1`), the profile the tier's engines run on."""
    from engine.metrics import ServingTimes

    obs = Observer()
    a = ServingTimes(steps=10, step_s=1.0, draft_s=0.2, priced_target_s=0.5, gaps=9, gap_s=0.01)
    b = ServingTimes(steps=5, step_s=0.5, requests=2, request_s=0.8)
    obs.report("a", engine_stats(serving=a))
    obs.report("b", engine_stats(serving=b))
    target = obs.health()["target"]
    assert target["serving"]["steps"] == 15 and target["serving"]["step_s"] == pytest.approx(1.5)
    assert target["serving"]["gaps"] == 9 and target["serving"]["requests"] == 2
    assert "_ended" not in target["serving"] and "cost_profile" not in target
    assert obs.health(profile=True)["target"]["cost_profile"] == COST.base.to_dict()


def test_health_shows_the_prefix_cache_hit_rate_over_the_replicas():
    obs = Observer()
    obs.report("a", engine_stats(prefix_cache_queries=1000, prefix_cache_hits=600))
    obs.report("b", engine_stats(prefix_cache_queries=3000, prefix_cache_hits=400))
    target = obs.health()["target"]
    assert (target["prefix_cache_queries"], target["prefix_cache_hits"]) == (4000, 1000)
    assert target["prefix_cache_hit_rate"] == 0.25
    obs.report("c", engine_stats(), "small")
    assert obs.health()["small"]["prefix_cache_hit_rate"] is None   # nothing looked up yet


def test_a_tier_is_down_when_every_replica_says_so_or_none_is_left():
    """Available while starting (nothing reported yet) and while one replica is up; down when
    every replica reports itself unavailable (its engine restarting) or all have gone. The
    policy then sends a caller who allows it around the tier."""
    obs = Observer()
    assert obs.cluster_stats().target.available            # starting: nothing known yet
    obs.report("a", engine_stats(available=False))
    obs.report("b", engine_stats())
    assert obs.cluster_stats().target.available
    obs.report("b", engine_stats(available=False))
    assert not obs.cluster_stats().target.available
    obs.report("s", engine_stats(cost=None, draft_kv_bytes_per_token=0.0), "small")
    d = choose_tier(TierRequest(allow_downgrade=True), obs.cluster_stats(), PolicyState())
    assert (d.tier, d.reason) == ("small", "tier_down")
    obs.report("a", engine_stats())
    assert obs.cluster_stats().target.available
    obs.retain("target", [])
    assert not obs.cluster_stats().target.available         # every replica gone
    obs.retain("small", [])
    d = choose_tier(TierRequest(plan="economy"), obs.cluster_stats(), PolicyState())
    assert (d.tier, d.reason) == ("small", "plan_economy")   # both down: its own tier


def test_a_small_tier_that_scales_to_zero_is_cold_not_down_when_it_has_no_replica():
    """With `min_replicas: 0` the small tier's autoscaler may leave no replica: the tier is then
    cold (economy goes to baseline as `small_cold`, and the ingress wakes it), not down; with a
    replica again it serves economy."""
    for scales in (frozenset({"small"}), frozenset()):
        obs = Observer(scales_to_zero=scales)
        obs.report("a", engine_stats())
        small = obs.cluster_stats().small
        assert small.cold == ("small" in scales) and small.available != small.cold
        d = choose_tier(TierRequest(plan="economy"), obs.cluster_stats(), PolicyState())
        assert (d.tier, d.reason) == (("baseline", "small_cold") if scales else
                                      ("small", "plan_economy"))
        obs.report("s", engine_stats(cost=None, draft_kv_bytes_per_token=0.0), "small")
        assert not obs.cluster_stats().small.cold
        obs.retain("small", [])
        assert obs.cluster_stats().small.cold == ("small" in scales)


def test_a_tier_is_lost_when_every_replica_it_had_stops_reporting():
    """What the ingress checks while a call waits for its first chunk (router/ingress.py:
    `Ingress._first`): lost once the tier had replicas and none reports, not while it starts,
    not with a replica (even one whose engine restarts: it answers at once), and never for a
    tier that scales to zero (a call waits for the replica it starts)."""
    for scales in (frozenset(), frozenset({"small"})):
        obs = Observer(scales_to_zero=scales)
        assert not obs.lost("small")                        # starting: none has reported
        obs.report("s", engine_stats(cost=None, draft_kv_bytes_per_token=0.0), "small")
        assert not obs.lost("small")
        obs.report("s", engine_stats(available=False, cost=None, draft_kv_bytes_per_token=0.0),
                   "small")
        assert not obs.lost("small")
        obs.retain("small", [])
        assert obs.lost("small") == (not scales)
        assert not obs.lost("target")
