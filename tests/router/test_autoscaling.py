"""router/autoscaling.py: each rule of the table in its docstring, and Serve's adapter."""

import pytest

from router.autoscaling import Autoscaling, ReplicaLoad, ScaleState, TierAutoscaler, decide

RULE = Autoscaling(min_replicas=1, max_replicas=4, target_sequences=8, ttft_p95_s=2.0,
                   kv_ceiling=0.9, upscale_delay_s=10, downscale_delay_s=60)
CALM = ReplicaLoad(sequences=4, kv_used=0.3, ttft_p95_s=0.5)


def _held(loads, current=2, rule=RULE, start=100.0, for_s=0.0, waiting=0.0):
    """The decision after the loads held from `start` for `for_s` seconds (two calls)."""
    first = decide(current, loads, rule, ScaleState(), start, waiting)
    return first, decide(current, loads, rule, first.state, start + for_s, waiting)


@pytest.mark.parametrize("load,reason,want", [
    (ReplicaLoad(4, 0.3, 3.5), "ttft_over_target", 3),
    (ReplicaLoad(28, 0.3, 0.5), "queue_over_target", 4),       # ceil((28 + 4) / 8)
    (ReplicaLoad(8, 0.95, 0.5), "kv_full", 3),
])
def test_each_upscale_signal_scales_up_after_its_delay(load, reason, want):
    first, later = _held([load, CALM], for_s=10.0)
    assert (first.replicas, first.reason) == (2, "hold")           # within the delay
    assert (later.replicas, later.reason) == (want, reason)


def test_a_burst_shorter_than_the_upscale_delay_scales_nothing():
    busy = [ReplicaLoad(20, 0.3, 0.5), CALM]
    first = decide(2, busy, RULE, ScaleState(), 100.0)
    calm = decide(2, [CALM, CALM], RULE, first.state, 105.0)        # the burst ended
    again = decide(2, busy, RULE, calm.state, 109.0)                # a new one: a new clock
    assert [d.replicas for d in (first, calm, again)] == [2, 2, 2]
    assert again.state.up_since == 109.0


def test_scale_down_waits_for_the_stable_period():
    idle = [ReplicaLoad(1, 0.1, 0.2), ReplicaLoad(1, 0.1, 0.2)]     # 2 <= (2 - 1) * 8 * 0.5
    early, late = _held(idle, for_s=59.0)
    assert (early.replicas, late.replicas) == (2, 2) and late.reason == "hold"
    _, done = _held(idle, for_s=60.0)
    assert (done.replicas, done.reason) == (1, "stable_low")


def test_load_that_comes_back_restarts_the_stable_period():
    idle = [ReplicaLoad(1, 0.1, 0.2), ReplicaLoad(1, 0.1, 0.2)]
    first = decide(2, idle, RULE, ScaleState(), 100.0)
    busy = decide(2, [ReplicaLoad(5, 0.3, 0.5)] * 2, RULE, first.state, 130.0)
    back = decide(2, idle, RULE, busy.state, 140.0)
    assert decide(2, idle, RULE, back.state, 170.0).replicas == 2    # 30 s since 140, not 70
    assert decide(2, idle, RULE, back.state, 200.0).replicas == 1


def test_load_that_would_crowd_one_replica_fewer_holds():
    # 6 sequences: one replica fewer at half the target holds 4, so two stay
    first, later = _held([ReplicaLoad(3, 0.3, 0.5)] * 2, for_s=600.0)
    assert (later.replicas, later.reason) == (2, "hold")


def test_bounds_clamp_every_answer():
    _, up = _held([ReplicaLoad(40, 0.3, 0.5)] * 4, current=4, for_s=10.0)
    assert up.replicas == 4
    _, down = _held([ReplicaLoad(0, 0.0, None)], current=1, for_s=600.0)
    assert (down.replicas, down.reason) == (1, "hold")              # min_replicas 1


def test_scale_to_zero_when_idle_and_back_on_the_first_request():
    rule = RULE.model_copy(update={"min_replicas": 0})
    _, idle = _held([ReplicaLoad(0, 0.0, None)], current=1, rule=rule, for_s=60.0)
    assert (idle.replicas, idle.reason) == (0, "stable_low")
    cold = decide(0, [], rule, ScaleState(), 500.0, waiting_at_handles=1)
    assert (cold.replicas, cold.reason) == (1, "cold_start")
    assert decide(0, [], rule, ScaleState(), 500.0).replicas == 0


def test_no_reports_keep_the_count():
    d = decide(3, [], RULE, ScaleState(up_since=5.0), 100.0)
    assert (d.replicas, d.reason, d.state) == (3, "no_stats", ScaleState(up_since=5.0))


def test_ttft_is_no_signal_without_a_target():
    rule = RULE.model_copy(update={"ttft_p95_s": None})
    _, later = _held([ReplicaLoad(4, 0.3, 30.0), CALM], rule=rule, for_s=30.0)
    assert later.replicas == 2


def test_the_config_refuses_bad_bounds():
    with pytest.raises(ValueError, match="below min_replicas"):
        Autoscaling(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="initial_replicas"):
        Autoscaling(min_replicas=1, max_replicas=2, initial_replicas=3)
    from router.config import AppConfig

    with pytest.raises(ValueError, match="not both"):
        AppConfig.model_validate({"target": {"model": "/m", "num_replicas": 2, "autoscaling": {}}})


def test_serves_adapter_reads_the_replicas_metrics_and_keeps_its_state():
    """Serve's own `AutoscalingContext`, as its controller builds it, through the policy."""
    from ray.serve.config import AutoscalingContext

    policy = TierAutoscaler(**RULE.model_dump())

    def ctx(now, state, sequences):
        metrics = {"sequences": {"r1": sequences, "r2": sequences},
                   "kv_used": {"r1": 0.2, "r2": 0.2}, "ttft_p95_s": {"r1": 0.0, "r2": 0.4}}
        return AutoscalingContext(None, "TargetServer", "specserve", 2, 2, ["r1", "r2"],
                                  2 * sequences, 0.0, metrics, None, 1, 4, state, None, None,
                                  now, None)
    n, state = policy(ctx(100.0, {}, 20.0))
    assert n == 2 and state["up_since"] == 100.0
    n, state = policy(ctx(111.0, state, 20.0))
    assert (n, state["reason"], state["up_since"]) == (4, "queue_over_target", None)


def test_while_replicas_start_the_count_holds_at_serves_target():
    """A scale-up's replica takes seconds to start; meanwhile the load that asked for it still
    shows on the running replicas. The rule holds at the target: it neither asks again (its
    upscale clock restarted) nor falls back to the running count, which Serve would take as a
    scale-down of the starting replica."""
    busy = [ReplicaLoad(20, 0.3, 0.5), ReplicaLoad(20, 0.3, 0.5)]
    up = decide(2, busy, RULE, ScaleState(up_since=0.0), 100.0)
    assert (up.replicas, up.reason) == (4, "queue_over_target")
    for t in (100.5, 101.0, 130.0):
        d = decide(2, busy, RULE, up.state, t, target=4)
        assert (d.replicas, d.reason) == (4, "starting")
    cold = decide(0, [], RULE.model_copy(update={"min_replicas": 0}), ScaleState(), 5.0, target=1)
    assert (cold.replicas, cold.reason) == (1, "starting")


def test_a_replicas_recent_ttft_is_the_nearest_rank_p95_of_its_window():
    """What a replica reports as `ttft_p95_s` (deployments/metrics.py: RecentTimes): first
    tokens older than the window drop out, and at most `max_kept` are kept."""
    from deployments.metrics import RecentTimes

    recent = RecentTimes(window_s=10.0, max_kept=50)
    assert recent.percentile(0.0) is None
    for i in range(60):                      # the first ten fall off the cap
        recent.add(float(i) / 10, float(i))
    assert recent.percentile(6.0) == 57.0    # rank ceil(0.95 * 50) = 48 of 10..59
    assert recent.percentile(6.0, 0.5) == 34.0
    assert recent.percentile(14.05) == 59.0  # only what came after 4.05 s: 41..59
    assert recent.percentile(100.0) is None
