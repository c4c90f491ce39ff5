"""`specserve simulate --scenario local-cpu`: the served engine's step times (its profile plus
what it learnt while serving), and a bench serve run mirrored load for load."""

import argparse
import json
import math
import statistics

import pytest

from cluster.sim.local import REPO_MIX, WorkloadShape, add_arguments, run_local, serving_cost
from cluster.sim.served import bench_acceptance, bench_learnt, bench_path, window_level
from engine.step_cost import LinearCost, LinearStepCost


def _run(policy, acceptance=None, per_seq_ms=None, spec_scale=None, running=None, draft_bytes=None):
    target = {"mean_token_acceptance": acceptance, "cost_per_seq_ms": per_seq_ms, "cost_spec_scale": spec_scale,
              "peak_running": running, "peak_kv_used_draft_bytes": draft_bytes}
    return {"policy": policy, "health_peaks": {"target": {k: v for k, v in target.items() if v is not None}}}


def test_what_the_replica_learnt_is_read_from_the_runs_that_show_it():
    bench = {"runs": [_run("standard", per_seq_ms=0.5, spec_scale=1.0),     # nobody drafted
                      _run("always-adaptive", 0.7, per_seq_ms=0.3, spec_scale=1.4),
                      _run("always-adaptive", 0.6, per_seq_ms=0.4, spec_scale=1.2),
                      _run("auto", 0.2, per_seq_ms=0.4, spec_scale=3.0)]}     # auto may not draft
    assert bench_learnt(bench) == {"per_seq_ms": pytest.approx(0.4), "spec_scale": pytest.approx(1.3)}
    # a run of only always-adaptive (no premium) still gives the acceptance
    assert bench_acceptance(bench) == pytest.approx(0.65)
    assert bench_learnt({"runs": [_run("standard")]}) == {}
    assert bench_acceptance({}) is None


def test_a_policys_own_windows_give_what_was_learnt_batch_by_batch():
    """Per policy: the per-sequence price and the draft's price factor at each window's peak
    batch (medians where windows share one). The policies whose requests draft pool their
    windows in which the draft ran; the others keep their own."""
    bench = {"runs": [_run("always-adaptive", per_seq_ms=0.5, spec_scale=1.2, running=1, draft_bytes=10),
                      _run("always-adaptive", per_seq_ms=0.1, spec_scale=2.0, running=32, draft_bytes=10),
                      _run("auto", per_seq_ms=0.3, spec_scale=2.4, running=32, draft_bytes=10),
                      _run("always-adaptive", per_seq_ms=0.2, spec_scale=9.0, running=16, draft_bytes=0),
                      _run("standard", per_seq_ms=0.04, spec_scale=1.6, running=32)]}
    drafting = {"per_seq_ms": {1: 0.5, 32: pytest.approx(0.2)}, "spec_scale": {1: 1.2, 32: pytest.approx(2.2)}}
    assert bench_learnt(bench, "always-adaptive") == drafting
    assert bench_learnt(bench, "auto") == drafting
    assert bench_learnt(bench, "standard") == {"per_seq_ms": {32: 0.04}}
    assert bench_learnt(bench, "economy") == {}


def test_serving_cost_reads_what_was_learnt_at_the_steps_batch():
    base = LinearStepCost(LinearCost(0.010, 0.001, 0.0001), LinearCost(0.002, 0.0005, 0.0))
    cost = serving_cost(base, learnt={"per_seq_ms": {1: 0.5, 16: 0.2}, "spec_scale": {1: 1.2, 32: 2.4}})
    for n, per_seq_ms, scale in ((1, 0.5, 1.2), (16, 0.2, 1.2 + 1.2 * 15 / 31), (32, 0.2, 2.4), (64, 0.2, 2.4)):
        assert cost.target_s(n, n) == pytest.approx(base.target_s(n, n) + n * per_seq_ms / 1e3)
        assert cost.draft_s(n, n) == pytest.approx(scale * base.draft_s(n, n))
    mixed = serving_cost(base, learnt={"per_seq_ms": {8: 0.3}, "spec_scale": 1.5})
    assert mixed.draft_s(4, 4) == pytest.approx(1.5 * base.draft_s(4, 4))
    assert mixed.target_s(2, 2) == pytest.approx(base.target_s(2, 2) + 2 * 0.3e-3)


def test_serving_cost_adds_what_was_learnt_to_the_profile():
    base = LinearStepCost(LinearCost(0.010, 0.001, 0.0001), LinearCost(0.002, 0.0005, 0.0))
    plain = serving_cost(base)
    assert plain.target_s(4, 4) == pytest.approx(base.target_s(4, 4))
    assert plain.draft_s(4, 4) == pytest.approx(base.draft_s(4, 4))
    cost = serving_cost(base, overhead_s=0.003, learnt={"per_seq_ms": 0.5, "spec_scale": 1.5})
    assert cost.target_s(4, 4) == pytest.approx(base.target_s(4, 4) + 0.003 + 4 * 0.0005)
    assert cost.draft_s(4, 4) == pytest.approx(1.5 * base.draft_s(4, 4))


def _app_yaml(family, tmp_path):
    config = tmp_path / "app.yaml"
    config.write_text(f"""app:
  name: specserve
  target: {{model: "{family}/target", draft: "{family}/draft", dtype: float32, num_threads: 1, max_num_seqs: 8}}
  small: {{model: "{family}/small", num_threads: 1, max_num_seqs: 8}}
""")
    return config


def _simulate(bench: dict, tmp_path) -> dict:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=lambda p: tmp_path / p)
    args = parser.parse_args(["--bench", str(path), "--json", "out.json"])
    assert run_local(args) == 0
    return json.loads((tmp_path / "out.json").read_text())


def test_local_cpu_mirrors_a_bench_run_users_and_poisson_rates(tiny_family, tmp_path):
    """Given a bench JSON, the simulation takes its family, config, policies and loads, open
    loop at its Poisson rates, and joins each row with what was measured."""
    family = tiny_family["target"].parent
    config = _app_yaml(family, tmp_path)
    measured = lambda p, kind, load: {"policy": p, "load_kind": kind, "load": load,   # noqa: E731
                                      "output_tok_s": 100.0, "e2e_s": {"p95": 1.0}}
    bench = {"args": {"start_local": str(family), "config": str(config), "users": "2", "rates": "0.5",
                      "policies": "standard,always-adaptive", "output_tokens": 16, "output_spread": 0.5},
             "results": [measured("standard", "users", 2), measured("always-adaptive", "rate", 0.5)],
             "runs": [_run("always-adaptive", 0.5, per_seq_ms=0.1, spec_scale=1.2, running=2, draft_bytes=1)]}
    out = _simulate(bench, tmp_path)
    assert out["learnt"] == {"always-adaptive": {"per_seq_ms": {"2": 0.1}, "spec_scale": {"2": 1.2}},
                             "standard": {"per_seq_ms": 0.1, "spec_scale": 1.2}}   # its own, or the pooled
    assert out["acceptance"] == 0.5
    rows = {(r["policy"], r["load_kind"], r["load"]): r for r in out["rows"]}
    assert set(rows) == {(p, k, v) for p in ("standard", "always-adaptive") for k, v in (("users", 2), ("rate", 0.5))}
    assert rows[("standard", "users", 2)]["measured_tok_s"] == 100.0
    assert rows[("always-adaptive", "users", 2)]["measured_tok_s"] is None
    # open loop below saturation carries the offered load: 0.5 requests/s of ~16 tokens
    for p in ("standard", "always-adaptive"):
        assert 0.5 * 16 * 0.6 < rows[(p, "rate", 0.5)]["predicted_tok_s"] < 0.5 * 16 * 1.6


def test_a_mix_shapes_the_requests_as_bench_serve_draws_them():
    """Outputs scaled per class as bench serve scales them (long prompts get an eighth), the
    spread a share of the scaled mean; prompts at the weighted median and log-spread of the
    mix's prompts, each class by its share of requests, not by how many prompts it has."""
    assert WorkloadShape.of(REPO_MIX, 64, 0.5) == WorkloadShape(REPO_MIX, 64, 32)
    assert WorkloadShape.of({"long": 1.0}, 64, 0.5) == WorkloadShape({"long": 1.0}, 8, 4)
    assert WorkloadShape.of({"long": 1.0, "code": 3.0}, 64, 0.5).output_median == round(64 * 3.125 / 4)
    shape = WorkloadShape.of({"a": 1.0, "b": 3.0}, 64, 0.5).with_prompts({"a": [10, 10, 10], "b": [1000]})
    assert shape.prompt_median == 1000
    assert shape.prompt_sigma == pytest.approx(math.sqrt(0.25 * 0.75) * math.log(100))
    even = WorkloadShape.of({"a": 3.0, "b": 1.0}, 64, 0.5).with_prompts({"a": [10, 10, 10], "b": [1000]})
    assert even.prompt_median == 10


def test_local_cpu_mirrors_a_run_of_long_prompts_and_short_answers(tiny_family, tmp_path):
    """A bench run of another prompt source (`--mix long=1`): the simulated requests have its
    long prompts and its short answers, and open loop carries its offered output tokens."""
    family = tiny_family["target"].parent
    bench = {"args": {"start_local": str(family), "config": str(_app_yaml(family, tmp_path)),
                      "users": "", "rates": "0.5", "policies": "standard", "output_tokens": 16,
                      "output_spread": 0.5, "mix": "long=1"},
             "results": [], "runs": []}
    out = _simulate(bench, tmp_path)
    assert out["workload"]["output_median"] == 2 and out["workload"]["prompt_median"] > 500
    (row,) = out["rows"]
    assert 0.5 * 2 * 0.6 < row["predicted_tok_s"] < 0.5 * 2 * 1.6


def test_bad_input_is_a_message_not_a_traceback(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    assert run_local(parser.parse_args(["--bench", str(tmp_path / "missing.json")])) == 2
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert run_local(parser.parse_args(["--bench", str(tmp_path / "bad.json")])) == 2
    assert run_local(parser.parse_args(["--policies", "standard,fastest"])) == 2
    for mix in ("code", "nosuchclass=1"):          # malformed; a class with no prompts here
        (tmp_path / "mix.json").write_text(json.dumps({"args": {"mix": mix}, "results": []}))
        assert run_local(parser.parse_args(["--bench", str(tmp_path / "mix.json")])) == 2
    for profiles in ({"target": {"kind": "table"}}, {"target": "fast"}, ["table"]):
        (tmp_path / "profile.json").write_text(json.dumps({"results": [], "served_profiles": profiles}))
        assert run_local(parser.parse_args(["--bench", str(tmp_path / "profile.json")])) == 2
    err = capsys.readouterr().err
    assert "missing.json" in err and "not a `specserve bench serve` JSON" in err and "fastest" in err
    assert err.count("served_profiles are not step-cost profiles") == 3


def _window(policy, kind, load, mean_running, e2e_mean, engine_s, draft_bytes=1, **target):
    return {"policy": policy, "load_kind": kind, "load": load, "e2e_s": {"mean": e2e_mean},
            "health_peaks": {"target": {"peak_running": 32, "mean_running": mean_running,
                                        "peak_kv_used_draft_bytes": draft_bytes,
                                        "engine_request_s": engine_s, **target}}}


def test_what_the_served_steps_took_is_read_at_the_windows_mean_batch():
    """Windows that report ServingTimes give the steps' factors over their profile, the loop's
    gap and the serving path's time a request, at the window's mean batch (a Poisson window's
    peak of 32 is not the batch its steps ran at); the path is what callers waited beyond
    the engine."""
    bench = {"runs": [
        _window("auto", "rate", 4, 2.4, 0.40, 0.36, target_factor=1.3, draft_factor=1.5, loop_gap_ms=0.2),
        _window("always-adaptive", "rate", 4, 1.6, 0.42, 0.40, target_factor=1.1, draft_factor=1.1),
        _window("always-adaptive", "users", 8, 7.6, 0.70, 0.62, target_factor=1.6, draft_factor=2.0),
        _window("standard", "rate", 4, 2.6, 0.50, 0.45, draft_bytes=0, target_factor=1.2,
                draft_factor=None)]}
    learnt = bench_learnt(bench, "auto")
    assert learnt["target_factor"] == {2: pytest.approx(1.2), 8: 1.6}
    assert learnt["draft_factor"] == {2: pytest.approx(1.3), 8: 2.0}
    assert learnt["gap_ms"] == {2: 0.2}
    assert learnt["path_s"] == {2: pytest.approx(0.03), 8: pytest.approx(0.08)}
    assert bench_learnt(bench, "standard") == {"target_factor": {2: 1.2}, "path_s": {2: pytest.approx(0.05)}}
    assert bench_path(bench, "always-adaptive", "rate", 4) == pytest.approx(0.03)   # with auto's
    assert bench_path(bench, "standard", "rate", 4) == pytest.approx(0.05)
    assert bench_path(bench, "standard", "users", 8) == 0.0                         # not measured


def test_serving_cost_times_steps_by_what_they_took_against_the_profile():
    base = LinearStepCost(LinearCost(0.010, 0.001, 0.0001), LinearCost(0.002, 0.0005, 0.0))
    cost = serving_cost(base, learnt={"per_seq_ms": 5.0, "spec_scale": 9.0, "gap_ms": {1: 0.2, 9: 1.0},
                                      "target_factor": {1: 1.2, 9: 1.6}, "draft_factor": 2.0})
    assert cost.target_s(5, 5) == pytest.approx(1.4 * base.target_s(5, 5))   # not + per_seq
    assert cost.draft_s(5, 5) == pytest.approx(2.0 * base.draft_s(5, 5))     # not spec_scale
    assert cost.gap_s(5) == pytest.approx(0.6e-3)
    assert serving_cost(base).gap_s(5) == 0.0


def test_a_simulated_step_takes_the_loops_gap_which_the_engine_does_not_calibrate_on():
    from cluster.sim.replica import Replica, ReplicaConfig, Seq
    from cluster.sim.scenarios import RequestSpec

    base = LinearStepCost(LinearCost(0.010, 0.0, 0.0), LinearCost(0.002, 0.0, 0.0))
    spec = RequestSpec(0, 0, 16, 400, 400, "code", 0.5, 0.0, 1)
    learnt = {}
    for gap_ms, per_seq_ms in ((0.0, 0.0), (3.0, 0.0), (0.0, 1.0), (3.0, 1.0)):
        truth = serving_cost(base, learnt={"gap_ms": gap_ms, "per_seq_ms": per_seq_ms})
        r = Replica(ReplicaConfig(truth, [1e12], [0.0], [10.0], [0.0], believed=base))
        r.waiting.append(Seq(spec, 0.0))
        r.admit(0.0, 60.0)
        now = 0.0
        for _ in range(300):
            seconds, decode, chunks = r.plan_step()
            now += seconds
            r.apply_step(now, seconds, decode, chunks)
        assert seconds == pytest.approx(0.010 + (gap_ms + per_seq_ms) / 1e3)
        learnt[gap_ms, per_seq_ms] = r.belief.per_seq_s
    # the engine learns the per-sequence overhead it times, never the loop's gap
    assert learnt[3.0, 0.0] == pytest.approx(0.0, abs=1e-9) and learnt[0.0, 0.0] == pytest.approx(0.0, abs=1e-9)
    assert learnt[3.0, 1.0] == pytest.approx(learnt[0.0, 1.0]) and learnt[0.0, 1.0] > 0.5e-3


def test_a_window_is_timed_at_its_own_level_with_the_curves_shape():
    """The machine's speed drifts within a run: a window's prediction keeps the batch-by-batch
    curve's shape and takes the level the window itself read at its mean batch."""
    bench = {"runs": [
        _window("standard", "users", 2, 2.0, 0.5, 0.4, draft_bytes=0, target_factor=1.2),
        _window("standard", "users", 8, 8.0, 0.5, 0.4, draft_bytes=0, target_factor=1.4),
        _window("standard", "rate", 10, 5.0, 0.5, 0.4, draft_bytes=0, target_factor=1.95)]}
    learnt = bench_learnt(bench, "standard")["target_factor"]
    assert learnt == {2: 1.2, 4: 1.95, 8: 1.4}     # batches to the nearest power of two
    curve = {2: 1.2, 8: 1.4}            # as if the Poisson window had not been pooled
    level = window_level(bench, {"target_factor": curve}, "standard", "rate", 10)
    # the curve at batch 5 is 1.3; the window read 1.95: everything 1.5x
    assert level["target_factor"] == {2: pytest.approx(1.8), 8: pytest.approx(2.1)}
    same = window_level(bench, {"target_factor": curve}, "standard", "users", 8)
    assert same["target_factor"] == {2: pytest.approx(1.2), 8: pytest.approx(1.4)}
    assert window_level(bench, {"target_factor": curve}, "standard", "users", 4) == {"target_factor": curve}


def test_repeated_windows_pool_their_requests_and_time():
    from cluster.sim.local import pooled_row
    from cluster.sim.replica import ReplicaConfig
    from cluster.sim.scenarios import Workload, fixed_mix
    from cluster.sim.simulator import simulate

    base = LinearStepCost(LinearCost(0.010, 0.001, 0.0), LinearCost(0.002, 0.0, 0.0))
    w = Workload(closed_loop=False, prompt_median=16, output_median=20, output_spread=0.5, max_tokens=30,
                 requests=50)
    runs = [simulate(ReplicaConfig(base, [1e12], [0.0], [10.0], [0.0]), None, "baseline", w,
                     fixed_mix(0.5), 20.0, seed) for seed in (0, 1, 2)]
    row = pooled_row(runs)
    assert row["throughput_tok_s"] == pytest.approx(sum(r.window_tokens for r in runs)
                                                    / sum(r.window_s for r in runs))
    e2e = sorted(s.finish_s - s.arrival_s for r in runs for s in r.seqs)
    assert row["completed"] == len(e2e) == 150
    assert row["p95_latency_s"] == pytest.approx(statistics.quantiles(e2e, n=100, method="inclusive")[94])
    assert pooled_row(runs[:1]) == runs[0].row()
