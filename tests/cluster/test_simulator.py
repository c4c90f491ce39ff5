"""cluster.sim.simulator: the analytic speed-up at one user, determinism, memory admission."""

import argparse
import random
import statistics
from dataclasses import replace

import pytest

from cluster.sim import simulate as cli
from cluster.sim.scenarios import MIXES, SCENARIOS, Deployment, Workload, fixed_mix, make_request
from cluster.sim.replica import ReplicaConfig, build_replicas
from cluster.sim.simulator import simulate
from engine.step_cost import LinearCost, LinearStepCost
from engine.hardware import GPUS, MODELS, GiB, RooflineStepCost

LINEAR = LinearStepCost(LinearCost(20e-3, 0.0, 0.0), LinearCost(3e-3, 0.0, 0.0))  # c = 0.15
ROOFLINE = RooflineStepCost(GPUS["A100-80GB"], MODELS["Llama-2-70B"], MODELS["Llama-2-7B"], tp=4, draft_tp=4)
LONG_OUTPUTS = Workload(prompt_median=16, prompt_sigma=0.0, output_median=600, output_sigma=0.0,
                        max_tokens=1024, requests=24)


def replica(cost, fixed_k=0, draft=True, memory=1e12, kv_per_token=1000.0, **kw) -> ReplicaConfig:
    return ReplicaConfig(cost, [memory], [0.0], [kv_per_token], [kv_per_token if draft else 0.0],
                         fixed_k=fixed_k, **kw)


def speedup(cost, a: float, k: int) -> float:
    mix = fixed_mix(a)
    base = simulate(replica(cost, draft=False), None, "baseline", LONG_OUTPUTS, mix, 1, seed=0).row()
    spec = simulate(replica(cost, fixed_k=k), None, "speculative", LONG_OUTPUTS, mix, 1, seed=0).row()
    return spec["throughput_tok_s"] / base["throughput_tok_s"]


@pytest.mark.parametrize("cost", [LINEAR, ROOFLINE], ids=["linear", "roofline-70b-sharded"])
@pytest.mark.parametrize("a,k", [(0.58, 4), (0.75, 4), (0.75, 2), (0.4, 3)])
def test_one_user_speedup_matches_analytic(cost, a, k):
    c = cost.draft_s(1, 1, 300) / cost.target_s(1, 1, 300)
    analytic = (1 - a ** (k + 1)) / (1 - a) / (k * c + 1)
    assert speedup(cost, a, k) == pytest.approx(analytic, rel=0.05)


def test_same_seed_same_result():
    target, small = build_replicas(SCENARIOS["seed-4xa100"].deployment, "sharded", "auto", 4)
    w = replace(SCENARIOS["seed-4xa100"].workload, requests=24)
    first = simulate(target, small, "auto", w, MIXES["article"], 4, seed=7).row()
    again = simulate(target, small, "auto", w, MIXES["article"], 4, seed=7).row()
    other = simulate(target, small, "auto", w, MIXES["article"], 4, seed=8).row()
    assert first == again
    assert first != other


def test_requests_are_the_same_under_every_policy_and_load():
    w, mix = SCENARIOS["seed-4xa100"].workload, MIXES["article"]
    assert make_request(w, mix, 3, 5, 2, 4096) == make_request(w, mix, 3, 5, 2, 4096)
    assert make_request(w, mix, 3, 5, 2, 4096) != make_request(w, mix, 3, 5, 3, 4096)


def test_paged_kv_admits_what_fits_now_and_preempts_when_it_runs_out():
    w = Workload(prompt_median=16, prompt_sigma=0.0, output_median=40, output_sigma=0.0, max_tokens=64,
                 requests=30)
    # 200 tokens of KV: a reservation of prompt + max_tokens (80) would admit two at a time; pages
    # (16 + 40 tokens, 64 in blocks) fit three, so three users never wait and nothing is preempted.
    roomy = 200 * 1000.0
    run = simulate(replica(LINEAR, draft=False, memory=roomy), None, "baseline", w, fixed_mix(0.5), 3, seed=0)
    row = run.row()
    assert row["completed"] == 30 and row["preemptions"] == 0
    assert row["p95_queue_s"] <= 0.021  # at most the step in flight (20 ms), never a whole request
    assert run.peak_memory_gib * GiB <= roomy
    # 150 tokens: three admitted prompts (32 tokens each in blocks, plus a growth block per
    # running request) outgrow it; the newest are preempted and recomputed, every request still
    # completes with every token, and memory never overflows.
    tight = 150 * 1000.0
    run = simulate(replica(LINEAR, draft=False, memory=tight), None, "baseline", w, fixed_mix(0.5), 3, seed=0)
    row = run.row()
    assert row["refused"] == 0 and row["completed"] == 30 and row["preemptions"] > 0
    assert all(s.emitted == 40 for s in run.seqs)
    assert run.peak_memory_gib * GiB <= tight
    too_small = replica(LINEAR, draft=False, memory=50 * 1000.0)  # prompt + max_tokens never fits
    assert simulate(too_small, None, "baseline", w, fixed_mix(0.5), 1, seed=0).row()["refused"] == 30


def test_speculative_mode_charges_draft_kv():
    w = Workload(prompt_median=16, prompt_sigma=0.0, output_median=40, output_sigma=0.0, max_tokens=64,
                 requests=12)
    fits_base_not_spec = 80 * 1000.0 * 1.5  # 80 tokens x 1000 B fit; x 2000 B (with draft KV) do not
    spec = simulate(replica(LINEAR, fixed_k=2, memory=fits_base_not_spec), None, "speculative", w,
                    fixed_mix(0.5), 1, seed=0).row()
    assert spec["refused"] == 12


def test_draft_placement_in_memory():
    dep = SCENARIOS["seed-4xa100"].deployment
    whole, _ = build_replicas(dep, "whole", "auto", 4)
    sharded, _ = build_replicas(dep, "sharded", "auto", 4)
    base, small = build_replicas(dep, "sharded", "baseline", 4)
    draft_bytes = MODELS["Llama-2-7B"].weight_bytes()
    assert whole.fixed_bytes[0] - whole.fixed_bytes[1] == pytest.approx(draft_bytes)
    assert whole.draft_kv[1:] == [0.0, 0.0, 0.0] and whole.draft_kv[0] == 524288
    assert len(set(sharded.fixed_bytes)) == 1 and sharded.draft_kv == [131072.0] * 4
    assert not any(base.draft_kv) and base.target_kv == [81920.0] * 4
    assert small is not None and len(small.gpu_bytes) == 1


def test_open_loop_poisson():
    w = Workload(closed_loop=False, prompt_median=64, output_median=64, requests=40)
    run = simulate(replica(LINEAR, draft=False), None, "baseline", w, fixed_mix(0.5), 5.0, seed=0).row()
    assert run["completed"] == 40 and run["requests_s"] == pytest.approx(5.0, rel=0.4)


def test_bad_arguments():
    with pytest.raises(ValueError):
        simulate(replica(LINEAR), None, "turbo", LONG_OUTPUTS, fixed_mix(0.5), 1, seed=0)
    with pytest.raises(ValueError):
        simulate(replica(LINEAR), None, "small", LONG_OUTPUTS, fixed_mix(0.5), 1, seed=0)
    with pytest.raises(ValueError):
        simulate(replica(LINEAR), None, "baseline", LONG_OUTPUTS, fixed_mix(0.5), 0, seed=0)


@pytest.mark.parametrize("name,median", [("article", 0.58), ("paper", 0.75)])
def test_mix_medians_match_the_sources(name, median):
    rng = random.Random(0)
    assert statistics.median(MIXES[name].draw(rng)[1] for _ in range(4000)) == pytest.approx(median, abs=0.02)


def test_check_rule():
    def rows(auto_thr, auto_p95):
        return [{"policy": p, "users": 8, "draft_placement": "sharded", "acceptance_mix": "article",
                 "throughput_tok_s": t, "p95_latency_s": l}
                for p, t, l in (("baseline", 100, 10.0), ("speculative", 120, 9.0), ("small", 300, 4.0),
                                ("auto", auto_thr, auto_p95))]
    assert cli.check(rows(118, 9.1), True)["pass"]
    assert not cli.check(rows(117, 9.1), True)["pass"]  # < 0.98 x 120
    assert not cli.check(rows(125, 9.2), True)["pass"]  # > 1.02 x 9.0
    adaptive = {"policy": "always-adaptive", "users": 8, "draft_placement": "sharded",
                "acceptance_mix": "article", "throughput_tok_s": 130, "p95_latency_s": 8.5}
    assert not cli.check(rows(125, 8.6) + [adaptive], True)["pass"]  # < 0.98 x 130
    assert cli.check(rows(128, 8.6) + [adaptive], True)["loads"][0]["best_fixed"] == "always-adaptive"


def test_cli_lists_and_rejects_unknown(capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["--list"])) == 0
    assert "seed-4xa100" in capsys.readouterr().out
    assert cli.run(parser.parse_args(["--scenario", "nope"])) == 2


def test_deployment_presets_are_consistent():
    for scn in SCENARIOS.values():
        dep: Deployment = scn.deployment
        assert dep.gpu in GPUS and dep.target in MODELS and (dep.draft is None or dep.draft in MODELS)
        for section in scn.sections:
            target, _ = build_replicas(dep, section.draft_placement, "auto", scn.fixed_k)
            assert all(f < m for f, m in zip(target.fixed_bytes, target.gpu_bytes))
