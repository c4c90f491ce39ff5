"""The honest simulator: fitted true step times, the engine's belief kept apart from them,
arrivals, SLO / goodput / cost, the small tier on the same GPUs, always-adaptive."""

import statistics
from dataclasses import replace

import pytest

from cluster.sim.fitted import FITTED
from cluster.sim.replica import ReplicaConfig
from cluster.sim.scenarios import Workload, fixed_mix, make_request
from cluster.sim.simulator import simulate
from engine.k_rule import choose_k
from engine.step_cost import LinearCost, LinearStepCost

LINEAR = LinearStepCost(LinearCost(20e-3, 0.0, 0.0), LinearCost(3e-3, 0.0, 0.0))  # c = 0.15
LONG = Workload(prompt_median=16, prompt_sigma=0.0, output_median=600, output_sigma=0.0,
                max_tokens=1024, requests=12)


def replica(cost, draft=True, **kw) -> ReplicaConfig:
    return ReplicaConfig(cost, [1e12], [0.0], [1000.0], [1000.0 if draft else 0.0], **kw)


def test_fitted_step_times_reproduce_the_published_points():
    sharded = FITTED[("A100-80GB", "Llama-2-70B", 4, 4)]
    whole = FITTED[("A100-80GB", "Llama-2-70B", 4, 1)]
    ms = pytest.approx
    assert sharded.target_s(1, 1, 128) * 1e3 == ms(29.0, abs=0.3)  # lmdeploy, batch 1 decode
    assert sharded.target_s(1, 128, 0) * 1e3 == ms(47.0, abs=0.5)  # TensorRT-LLM 0.5, prefill 128
    assert sharded.target_s(64, 64, 64 * 128) * 1e3 == ms(43.0, abs=0.5)  # lmdeploy, batch 64
    assert sharded.target_s(64, 64, 64 * 2048) * 1e3 == ms(55.0, abs=0.5)
    c = sharded.draft_s(1, 1, 128) / sharded.target_s(1, 1, 128)
    assert c == ms(0.22, abs=0.01)
    assert whole.draft_s(1, 1, 128) / whole.target_s(1, 1, 128) == ms(0.33, abs=0.02)
    assert sharded.draft_s(1, 1, 0) == sharded.draft_floor_s  # the latency floor holds at batch 1


def test_a_mismatch_scales_the_draft_and_nothing_else():
    true = FITTED[("A100-80GB", "Llama-2-70B", 4, 4)]
    dear, cheap = true.mismatched(0.3), true.mismatched(-0.3)
    assert true.mismatched(0.0) is true
    for n, t, ctx in ((1, 1, 128), (64, 64, 8192), (32, 160, 40000)):
        assert dear.draft_s(n, t, ctx) == pytest.approx(1.3 * true.draft_s(n, t, ctx))
        assert cheap.draft_s(n, t, ctx) == pytest.approx(0.7 * true.draft_s(n, t, ctx))
        assert dear.target_s(n, t, ctx) == cheap.target_s(n, t, ctx) == true.target_s(n, t, ctx)


def test_the_engine_picks_k_with_its_belief_and_steps_take_true_time():
    mix = fixed_mix(0.75)
    base = simulate(replica(LINEAR, draft=False), None, "baseline", LONG, mix, 1, seed=0).row()
    honest = simulate(replica(LINEAR), None, "always-adaptive", LONG, mix, 1, seed=0).row()
    assert honest["reasons"] == {"speculation_on": 12} and honest["throughput_tok_s"] > 1.5 * base["throughput_tok_s"]
    # believing the draft costs 10x the target: the engine drafts only to probe (and learns the
    # draft 4x cheaper, CAL_SCALE_RANGE's floor: still 2.5x the target), so always-adaptive runs
    # at the baseline's speed, which is still timed by the true model
    pessimist = LinearStepCost(LinearCost(20e-3, 0.0, 0.0), LinearCost(200e-3, 0.0, 0.0))
    doubting = simulate(replica(LINEAR, believed=pessimist), None, "always-adaptive", LONG, mix, 1, seed=0).row()
    assert doubting["speculative_fraction"] == 1.0
    assert doubting["throughput_tok_s"] == pytest.approx(base["throughput_tok_s"], rel=0.02)
    # a belief that the target is slow changes nothing: time is the truth's
    slow = LinearStepCost(LinearCost(2.0, 0.0, 0.0), LinearCost(3e-3, 0.0, 0.0))
    assert simulate(replica(LINEAR, draft=False, believed=slow), None, "baseline", LONG, mix, 1,
                    seed=0).row()["throughput_tok_s"] == pytest.approx(base["throughput_tok_s"])


def test_an_engine_that_believes_drafting_does_not_pay_probes_and_learns_that_it_does():
    """Priced at 10x its cost (30 ms a draft round against a 20 ms target step), drafting never
    pays by the belief, and it moves only with drafting steps: the engine's probes (`DraftProbe`)
    draft now and then, the step after a probe's catch-up is calibrated, and the learnt price
    (a quarter, CAL_SCALE_RANGE's floor) drafts. Without probes the engine stays at plain
    decoding for good (docs/decisions/0010-cost-calibration.md)."""
    mix = fixed_mix(0.75)
    base = simulate(replica(LINEAR, draft=False), None, "baseline", LONG, mix, 1, seed=0).row()
    dear = LinearStepCost(LinearCost(20e-3, 0.0, 0.0), LinearCost(30e-3, 0.0, 0.0))
    assert choose_k([0.75], [4], dear, max_slowdown=None) == [0]
    row = simulate(replica(LINEAR, believed=dear), None, "always-adaptive", LONG, mix, 1, seed=0).row()
    assert row["throughput_tok_s"] > 1.3 * base["throughput_tok_s"]
    assert row["calibrated_spec_scale"] == pytest.approx(0.25)


def test_the_simulated_engine_calibrates_its_belief_as_the_engine_does():
    true = LinearStepCost(LinearCost(20e-3, 1e-3, 0.0), LinearCost(3e-3, 0.0, 0.0))  # +1 ms a sequence
    row = simulate(replica(true, draft=False, believed=LINEAR), None, "baseline", LONG, fixed_mix(0.5), 4,
                   seed=0).row()
    # the engine's calibration (`draft_excess`), with its prior of 0 (PER_SEQ_PRIOR) still felt
    assert row["calibrated_per_seq_ms"] == pytest.approx(1.0, rel=0.05)
    over = LinearStepCost(LinearCost(20e-3, 0.0, 0.0), LinearCost(3e-3, 0.0, 0.0))
    believed_dear = LinearStepCost(LinearCost(30e-3, 0.0, 0.0), LinearCost(3e-3, 0.0, 0.0))
    row = simulate(replica(over, draft=False, believed=believed_dear), None, "baseline", LONG,
                   fixed_mix(0.5), 4, seed=0).row()
    assert row["calibrated_per_seq_ms"] == 0.0  # only costs above the base are learnt


@pytest.mark.parametrize("cv", [1.0, 3.0])
def test_open_loop_arrivals_have_the_rate_and_burstiness_asked_for(cv):
    w = Workload(closed_loop=False, arrival_cv=cv, prompt_median=16, output_median=8, output_sigma=0.0,
                 requests=2000)
    run = simulate(replica(LINEAR, draft=False), None, "baseline", w, fixed_mix(0.5), 4.0, seed=0)
    t = [s.arrival_s for s in run.seqs]
    gaps = [b - a for a, b in zip(t, t[1:])]
    mean = statistics.fmean(gaps)
    assert 1 / mean == pytest.approx(4.0, rel=0.15)
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.2)


@pytest.mark.parametrize("tpot_slo,attained", [(0.0199, 0.0), (0.0201, 1.0)])
def test_ttft_slo_goodput_and_cost_per_million_tokens(tpot_slo, attained):
    w = Workload(prompt_median=16, prompt_sigma=0.0, output_median=600, output_sigma=0.0, max_tokens=1024,
                 requests=6, slo_ttft_s=0.05, slo_tpot_s=tpot_slo)
    row = simulate(replica(LINEAR, draft=False), None, "baseline", w, fixed_mix(0.5), 1, seed=0,
                   gpu_hour_usd=3.6).row()
    assert row["p50_ttft_s"] == pytest.approx(0.02) and row["p95_per_token_s"] == pytest.approx(0.02)
    assert row["slo_attainment"] == attained
    assert row["goodput_tok_s"] == pytest.approx(attained * row["throughput_tok_s"])
    assert row["throughput_tok_s"] == pytest.approx(50.0, rel=0.01)  # one token per 20 ms step
    assert row["usd_per_m_tokens"] == pytest.approx(3.6 / 3600 / row["throughput_tok_s"] * 1e6)  # ~20


def test_the_small_tier_spreads_over_its_replicas_and_pays_for_their_gpus():
    per_seq = LinearStepCost(LinearCost(5e-3, 5e-3, 0.0), LinearCost(1e-3, 0.0, 0.0))
    w = Workload(prompt_median=16, prompt_sigma=0.0, output_median=64, output_sigma=0.0, max_tokens=128,
                 requests=64)
    one = simulate(replica(LINEAR, draft=False), replica(per_seq, draft=False), "small", w, fixed_mix(0.5), 8,
                   seed=0, gpu_hour_usd=2.0).row()
    four = simulate(replica(LINEAR, draft=False), replica(per_seq, draft=False), "small", w, fixed_mix(0.5), 8,
                    seed=0, small_replicas=4, gpu_hour_usd=2.0).row()
    assert (one["gpus"], four["gpus"]) == (1, 4)
    assert four["throughput_tok_s"] > 2.5 * one["throughput_tok_s"]  # 8 at 45 ms vs 2 each at 15 ms
    assert four["usd_per_m_tokens"] == pytest.approx(4 * 2.0 / 3600 / four["throughput_tok_s"] * 1e6)


def test_ttft_counts_the_wait_for_memory():
    w = Workload(prompt_median=16, prompt_sigma=0.0, output_median=40, output_sigma=0.0, max_tokens=64,
                 requests=10)
    one_at_a_time = ReplicaConfig(LINEAR, [80 * 1000.0], [0.0], [1000.0], [0.0])
    row = simulate(one_at_a_time, None, "baseline", w, fixed_mix(0.5), 2, seed=0).row()
    assert row["p95_queue_s"] > 0.3  # one request's KV at a time: the other user waits for it
    assert row["p95_ttft_s"] >= row["p95_queue_s"] + 0.02 - 1e-9  # its wait, then its prefill step


def test_article_claims_are_judged_per_placement_at_the_stated_tolerance():
    from cluster.sim.article import compare_article
    from cluster.sim.scenarios import ARTICLE_CLAIMS

    def r(policy, placement, tok_s):
        return {"policy": policy, "users": 48, "draft_placement": placement, "throughput_tok_s": tok_s}
    rows = [r("baseline", "sharded", 1000), r("speculative", "sharded", 660),   # 0.66: within 15% of 0.65
            r("baseline", "whole", 1000), r("speculative", "whole", 750)]       # 0.75: 15.4% off
    drop = next(c for c in ARTICLE_CLAIMS if c["id"] == "throughput_drop")
    (verdict,) = compare_article([drop], rows, [])
    assert verdict["ours"] == {"sharded": 0.66, "whole": 0.75}
    assert verdict["agrees"] == {"sharded": True, "whole": False}


def test_the_simulated_engine_chooses_k_for_goodput_as_the_engine_does():
    """The engine picks k for the batch's goodput with no latency guard (`LLMEngine._choose_k`:
    max_slowdown=None; the guard is the router's). The simulated engine must do the same, or
    always-adaptive is simulated slower than it serves: with the guard a baseline-mode sequence
    in the batch vetoed draft rounds that four well-accepting ones would have gained from."""
    from cluster.sim.replica import Replica, Seq
    from cluster.sim.scenarios import RequestSpec
    from engine.k_rule import choose_k

    r = Replica(replica(LINEAR))
    decode = []
    for i in range(5):
        spec = RequestSpec(i, 0, 16, 600, 1024, "chat", 0.9, 0.0, i)
        s = Seq(spec, 0.0, speculative=i < 4, k_cap=8 if i < 4 else 0)
        s.accepted, s.rejected, s.computed = 90, 5, 100
        decode.append(s)
    ks = r._choose_ks(decode, 500, 0)
    a = r.acceptance.value
    accs = [round(s.estimate(a), 2) for s in decode]
    assert ks == choose_k(accs, [8, 8, 8, 8, 0], r.belief, 4096, 0, max_slowdown=None)
    assert all(k > 0 for k in ks[:4]) and ks[4] == 0


def _decode_seqs(estimates: list[tuple[int, int]], speculative: int) -> list:
    """Decoding sequences with (accepted, rejected) counts; the first `speculative` draft."""
    from cluster.sim.replica import Seq
    from cluster.sim.scenarios import RequestSpec

    seqs = []
    for i, (acc, rej) in enumerate(estimates):
        spec = RequestSpec(i, 0, 16, 600, 1024, "chat", 0.9, 0.0, i)
        s = Seq(spec, 0.0, speculative=i < speculative, k_cap=8 if i < speculative else 0)
        s.accepted, s.rejected, s.computed, s.prefill_left = acc, rej, 100, 0
        seqs.append(s)
    return seqs


def test_the_simulated_engine_keeps_the_engines_min_gain_and_never_splits_a_batch():
    """k by the engine's rule (`engine_choose_k`): drafting only at MIN_GAIN over plain
    decoding (MIN_GAIN_ALONE for a sequence alone), and a batch never split into drafting and
    not (the ones left out finish later and alone), not goodput without either."""
    from cluster.sim.replica import Replica
    from engine.k_rule import choose_k

    r = Replica(replica(LINEAR))   # c = 0.15, no cost a token: k = 1 gains (1 + a) / 1.15
    # two sequences at a = 0.19 (gain 1.035) draft under pure goodput, not under MIN_GAIN;
    # at a = 0.22 (1.06) they do; alone, a = 0.19 drafts (MIN_GAIN_ALONE, 2%), a = 0.16
    # (1.009) does not
    assert r._choose_ks(_decode_seqs([(1900, 8100)] * 2, 2), 100, 0) == [0, 0]
    assert r._choose_ks(_decode_seqs([(2200, 7800)] * 2, 2), 100, 0) == [1, 1]
    assert r._choose_ks(_decode_seqs([(1900, 8100)], 1), 100, 0) == [1]
    assert r._choose_ks(_decode_seqs([(1600, 8400)], 1), 100, 0) == [0]
    # where tokens cost (1 ms a verified token, 0.3 ms a drafted one), a sequence at a = 0.05
    # beside four at 0.9 does not pay for its draft token, and drafts one anyway
    per_token = LinearStepCost(LinearCost(20e-3, 0.0, 1e-3), LinearCost(3e-3, 0.0, 0.3e-3))
    r = Replica(replica(per_token))
    seqs = _decode_seqs([(9000, 1000)] * 4 + [(500, 9500)], 5)
    accs = [round(s.estimate(r.acceptance.value), 2) for s in seqs]
    assert choose_k(accs, [8] * 5, per_token, 4096, 0, max_slowdown=None)[4] == 0
    ks = r._choose_ks(seqs, 500, 0)
    assert min(ks[:4]) > 1 and ks[4] == 1
    # a baseline-mode sequence stays at k = 0 beside them
    assert r._choose_ks(_decode_seqs([(9000, 1000)] * 4 + [(500, 9500)], 4), 500, 0)[4] == 0


def test_a_simulated_draft_reads_its_prompt_in_its_first_drafting_step():
    """As in the engine (`LLMEngine.step`: a draft that never ran feeds the whole context in
    the sequence's first drafting step), the prompt step is the target's alone and the draft's
    reading of the prompt is priced into the step that first drafts (`catch_up_prices`) and
    timed there, not in the prompt's step."""
    from cluster.sim.replica import Replica, Seq
    from cluster.sim.scenarios import RequestSpec

    per_token = LinearStepCost(LinearCost(20e-3, 0.0, 0.0), LinearCost(3e-3, 0.0, 0.1e-3))
    r = Replica(replica(per_token))
    spec = RequestSpec(0, 0, 64, 600, 1024, "chat", 0.9, 0.0, 0)
    seq = Seq(spec, 0.0, speculative=True, k_cap=8)
    r.waiting.append(seq)
    r.admit(0.0, 60.0)
    seconds, decode, chunks = r.plan_step()
    assert not decode and chunks == [(seq, 64)]
    assert seconds == pytest.approx(20e-3)             # the target's prompt step only
    r.apply_step(seconds, seconds, decode, chunks)
    assert seq.lag == 64                                # the draft has read none of the prompt
    seconds, decode, chunks = r.plan_step()
    ((s, k),) = decode
    assert k >= 1
    draft = 3e-3 * k + 0.1e-3 * (k + 64)                # k rounds; the first also reads the prompt
    assert seconds == pytest.approx(20e-3 + draft)
    r.apply_step(2 * seconds, seconds, decode, chunks)
    assert seq.lag == 0
    seconds, decode, _ = r.plan_step()
    ((s, k),) = decode
    assert seconds == pytest.approx(20e-3 + 3e-3 * k + 0.1e-3 * k)


def test_past_saturation_the_engines_queue_bound_refuses_and_caps_the_wait():
    """The engine refuses (429) a request that arrives while `max_waiting` wait (bench serve saw
    429s past saturation, and a p95 the bounded queue sets); unbounded, the queue and the
    latency grow for as long as the overload lasts."""
    w = Workload(closed_loop=False, prompt_median=16, prompt_sigma=0.0, output_median=50,
                 output_sigma=0.0, max_tokens=64, requests=40, queue_timeout_s=600)
    mix = fixed_mix(0.5)
    rows = {bound: simulate(replica(LINEAR, draft=False, max_num_seqs=2, max_waiting=bound), None,
                            "baseline", w, mix, 6.0, seed=0).row() for bound in (None, 4)}
    assert rows[None]["refused"] == 0 and rows[None]["p95_latency_s"] > 8.0
    assert rows[4]["refused"] > 10 and rows[4]["p95_latency_s"] < 4.0
    # below saturation the bound never binds
    light = simulate(replica(LINEAR, draft=False, max_num_seqs=2, max_waiting=4), None, "baseline",
                     w, mix, 0.5, seed=0).row()
    assert light["refused"] == 0


def test_the_simulated_engine_prices_the_draft_from_its_timed_rounds_as_the_engine_does(monkeypatch):
    """The engine times a step's draft rounds and verify forward apart (`CalibratedCost`,
    draft_excess), and the simulator's engines calibrate on the same split of the true step
    time: a draft dearer than believed is learnt as the draft's price. (A joint fit on the
    step's total confuses the two where the truth's draft price moves with the batch:
    docs/decisions/0010-cost-calibration.md.)"""
    from engine.calibration import CalibratedCost

    seen = []
    calibrate = CalibratedCost.calibrate

    def record(self, ks, ctx, seconds, **kw):
        assert self.draft_excess
        seen.append((max(ks), seconds, kw))
        calibrate(self, ks, ctx, seconds, **kw)

    monkeypatch.setattr(CalibratedCost, "calibrate", record)
    dear = LinearStepCost(LinearCost(20e-3, 0.0, 0.0), LinearCost(6e-3, 0.0, 0.0))   # 2x LINEAR's draft
    row = simulate(replica(dear, believed=LINEAR), None, "always-adaptive", LONG, fixed_mix(0.9), 8,
                   seed=0).row()
    drafting = [(k, secs, kw) for k, secs, kw in seen if k]
    assert len(drafting) > 100 and all(kw["could_draft"] for _, _, kw in seen)
    for k, secs, kw in drafting:      # the true parts: k rounds of 6 ms, one 20 ms verify
        assert kw["draft_seconds"] == pytest.approx(k * 6e-3) and kw["verify_seconds"] == pytest.approx(20e-3)
        assert secs == pytest.approx(kw["draft_seconds"] + kw["verify_seconds"])
    assert row["calibrated_spec_scale"] == pytest.approx(2.0, rel=0.02)
    assert row["calibrated_per_seq_ms"] == pytest.approx(0.0, abs=0.01)


def test_the_serving_path_is_in_every_latency_and_in_a_users_cycle():
    """Workload.path_s: a request reaches the engine that long after it is sent (HTTP, router,
    Ray). Closed loop, a user's cycle grows by it; open loop, the arrivals keep their rate."""
    short = Workload(prompt_median=16, prompt_sigma=0.0, output_median=10, output_sigma=0.0,
                     max_tokens=10, requests=40)
    rows = {p: simulate(replica(LINEAR, draft=False), None, "baseline", replace(short, path_s=p),
                        fixed_mix(0.5), 1, seed=0).row() for p in (0.0, 0.05)}
    assert rows[0.0]["p50_latency_s"] == pytest.approx(0.2)            # 10 steps of 20 ms
    assert rows[0.05]["p50_latency_s"] == pytest.approx(0.25)
    assert rows[0.05]["p50_ttft_s"] == pytest.approx(rows[0.0]["p50_ttft_s"] + 0.05)
    assert rows[0.05]["throughput_tok_s"] == pytest.approx(rows[0.0]["throughput_tok_s"] * 0.2 / 0.25, rel=0.02)
    open_loop = replace(short, closed_loop=False, requests=400)
    runs = {p: simulate(replica(LINEAR, draft=False), None, "baseline", replace(open_loop, path_s=p),
                        fixed_mix(0.5), 2.0, seed=0) for p in (0.0, 0.05)}
    t = {p: [s.arrival_s for s in r.seqs] for p, r in runs.items()}
    assert t[0.05] == pytest.approx([x + 0.05 for x in t[0.0]])       # shifted, not stretched
    assert runs[0.05].row()["p95_latency_s"] == pytest.approx(runs[0.0].row()["p95_latency_s"] + 0.05)


def test_bench_serves_lengths_uniform_around_the_mean():
    """output_spread: max_tokens uniform in median * (1 +- spread), every one of them emitted
    (bench serve's requests ignore eos)."""
    w = Workload(output_median=64, output_spread=0.5, max_tokens=96, prompt_median=16)
    specs = [make_request(w, fixed_mix(0.5), 0, 0, i, 512) for i in range(2000)]
    outs = [s.output_tokens for s in specs]
    assert all(s.output_tokens == s.max_tokens for s in specs)
    assert min(outs) == 32 and max(outs) == 96
    assert statistics.fmean(outs) == pytest.approx(64, abs=1.5)
    assert sum(o > 90 for o in outs) / len(outs) == pytest.approx(6 / 65, abs=0.02)
