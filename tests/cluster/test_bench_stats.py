"""The statistics of `specserve bench serve`, on hand-made records with known answers."""

import math

import pytest

from cluster.bench.stats import SLO, RequestRecord, mean_ci95, percentile, summarize


def test_percentile_interpolates_like_numpy():
    np = pytest.importorskip("numpy")
    values = [3.0, 1.0, 7.0, 4.0, 10.0, 2.5, 8.0]
    for q in (0, 10, 50, 90, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5


def _rec(sent, first, last, tokens, status=200, finished=None, usage_tokens=None, tier="baseline"):
    """A request streamed one token at a time evenly from `first` to `last`."""
    times = [first + (last - first) * i / max(tokens - 1, 1) for i in range(tokens)]
    return RequestRecord(policy="p", prompt_class="code", sent=sent, status=status,
                         finished=finished if finished is not None else last + 0.01,
                         token_times=[(t, 1) for t in times], prompt_tokens=5,
                         completion_tokens=tokens if usage_tokens is None else usage_tokens,
                         tier=tier, reason="r")


def test_ttft_tpot_e2e():
    r = _rec(sent=10.0, first=10.5, last=12.5, tokens=5)
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx(2.0 / 4)          # 4 gaps after the first token
    assert r.e2e == pytest.approx(2.51)
    assert _rec(0, 0.2, 0.2, 1).tpot is None


def test_slo_goodput_and_attainment():
    slo = SLO(ttft_s=1.0, tpot_s=0.125)                      # binary fractions: exact edges
    good = _rec(0.0, 0.5, 0.5 + 0.05 * 9, 10)                 # ttft 0.5, tpot 0.05: meets
    slow_first = _rec(1.0, 2.5, 2.5 + 0.05 * 9, 10)          # ttft 1.5: misses
    slow_decode = _rec(2.0, 2.2, 2.2 + 0.2 * 9, 10)          # tpot 0.2: misses
    edge = _rec(3.0, 4.0, 4.0 + 0.125 * 3, 4)                # exactly at both limits: meets
    error = RequestRecord(policy="p", prompt_class="code", sent=4.0, status=429, finished=4.01)
    warm = _rec(-5.0, -4.9, -4.0, 10)                        # before the window: excluded
    recs = [good, slow_first, slow_decode, edge, error, warm]
    s = summarize([(recs, 0.0, 10.0)], slo)
    assert s["requests_issued"] == 5 and s["requests_ok"] == 4
    assert s["slo_attainment"] == pytest.approx(2 / 5)      # errors count as misses
    assert s["goodput_requests_per_s"] == pytest.approx(2 / 10)
    assert s["goodput_tok_s"] == pytest.approx((10 + 4) / 10)
    assert s["errors_by_status"] == {"429": 1}
    assert s["completion_tokens_usage"] == s["completion_tokens_streamed"] == 34


def test_throughput_counts_tokens_inside_the_window_only():
    # 10 tokens from t=-1 to t=1: 5 fall at t >= 0 (the window [0, 2))
    spanning = RequestRecord(policy="p", prompt_class="code", sent=-1.5, status=200, finished=1.0,
                             token_times=[(-1 + 0.25 * i, 1) for i in range(9)] + [(2.5, 1)],
                             prompt_tokens=1, completion_tokens=10)
    s = summarize([([spanning], 0.0, 2.0)], SLO())
    inside = sum(1 for i in range(9) if 0 <= -1 + 0.25 * i < 2)
    assert s["output_tokens_in_window"] == inside
    assert s["output_tok_s"] == pytest.approx(inside / 2.0)
    assert s["requests_issued"] == 0                          # issued in the warm-up
    assert s["requests_per_s"] == pytest.approx(1 / 2.0)      # but finished inside


def test_pooled_windows_sum_time_and_pool_percentiles():
    a = [_rec(0.0, 0.1, 1.0, 10), _rec(1.0, 1.1, 3.0, 10)]
    b = [_rec(100.0, 100.1, 104.0, 20)]
    s = summarize([(a, 0.0, 10.0), (b, 100.0, 110.0)], SLO(ttft_s=10, tpot_s=10))
    assert s["window_s"] == 20.0
    assert s["output_tok_s"] == pytest.approx(40 / 20.0)
    e2e = sorted(r.e2e for r in a + b)
    assert s["e2e_s"]["p50"] == pytest.approx(e2e[1])
    assert s["e2e_s"]["p99"] == pytest.approx(percentile(e2e, 99))


def test_acceptance_is_token_weighted():
    r1 = _rec(0, 0.1, 1, 10, tier="speculative")
    r1.acceptance_rate, r1.mean_acceptance_length = 0.8, 3.0
    r2 = _rec(0, 0.1, 1, 30, tier="speculative")
    r2.acceptance_rate, r2.mean_acceptance_length = 0.4, 2.0
    s = summarize([([r1, r2, _rec(0, 0.1, 1, 50)], 0.0, 10.0)], SLO())
    assert s["acceptance_rate"] == pytest.approx((0.8 * 10 + 0.4 * 30) / 40)
    assert s["mean_acceptance_length"] == pytest.approx((3 * 10 + 2 * 30) / 40)
    assert s["tier_shares"] == {"baseline": pytest.approx(1 / 3), "speculative": pytest.approx(2 / 3)}


def test_mean_ci95_uses_student_t():
    out = mean_ci95([10.0, 12.0])
    assert out["mean"] == 11.0
    assert out["std"] == pytest.approx(math.sqrt(2))
    assert out["ci95"] == pytest.approx(12.706 * math.sqrt(2) / math.sqrt(2))
    assert mean_ci95([5.0])["ci95"] is None


def test_timeline_buckets_by_finish_time_and_class():
    """A draft swapped in mid-run shows as a step in one class's acceptance: the buckets must put
    each request where it finished and weight acceptance by its tokens."""
    from cluster.bench.stats import timeline

    def rec(cls, sent, finished, tokens, acc, status=200):
        r = _rec(sent, sent + 0.1, finished - 0.01, tokens, status=status, finished=finished)
        r.prompt_class, r.acceptance_rate = cls, acc
        return r

    recs = [rec("chat", -3.0, -0.5, 10, 0.5),                      # warm-up bucket [-4, 0)
            rec("chat", 0.0, 1.0, 10, 0.5), rec("chat", 0.5, 3.0, 30, 0.9),
            rec("code", 1.0, 3.5, 4, 0.8), rec("code", 2.0, 3.9, 4, None),
            rec("chat", 3.0, 4.5, 10, 0.7), rec("chat", 4.5, 5.0, 1, 0.0, status=500)]
    rows = timeline(recs, start=0.0, end=8.0, bucket_s=4.0)
    assert [r["t0_s"] for r in rows] == [-4.0, 0.0, 4.0]
    assert rows[0]["classes"]["chat"]["requests"] == 1
    mid = rows[1]["classes"]
    assert mid["chat"]["requests"] == 2
    assert mid["chat"]["acceptance_rate"] == pytest.approx((0.5 * 10 + 0.9 * 30) / 40)
    assert mid["code"]["requests"] == 2 and mid["code"]["acceptance_rate"] == pytest.approx(0.8)
    assert mid["code"]["tpot_p50_s"] == pytest.approx(((3.49 - 1.1) / 3 + (3.89 - 2.1) / 3) / 2)
    assert rows[2]["failed"] == 1 and rows[2]["classes"]["chat"]["requests"] == 1


def test_every_policy_opens_as_many_loads_and_repeats_as_the_others():
    """bench serve's window order: rotated by load and by repeat, so no policy always meets the
    engine first after a change of load (auto did, and read 0.92-0.94x of a policy configured
    the same way at 1-4 users)."""
    from collections import Counter

    from cluster.bench.serve import window_order

    policies = ["auto", "standard", "always-adaptive"]
    firsts = Counter(window_order(policies, load, 0)[0] for load in range(6))
    assert firsts == {p: 2 for p in policies}
    for load in range(4):
        orders = [window_order(policies, load, rep) for rep in range(3)]
        assert all(sorted(o) == sorted(policies) for o in orders)
        assert len({o[0] for o in orders}) == 3


def test_a_windows_serving_times_are_the_differences_of_its_first_and_last_reading():
    """`/health` reports cumulative ServingTimes; a window reads its own steps against their
    profile, the loop's gaps and a request's time in the engine from the readings inside it,
    and the mean of the running sequences sampled."""
    from cluster.bench.client import HealthSampler

    def reading(steps, step_s, draft_s, pt, pd, gaps, gap_s, req, req_s, running):
        return {"target": {"running": running, "serving": dict(
            steps=steps, step_s=step_s, draft_s=draft_s, priced_target_s=pt, priced_draft_s=pd,
            gaps=gaps, gap_s=gap_s, requests=req, request_s=req_s)}}

    h = HealthSampler(None)
    h.samples = [(0.0, reading(1, 9.0, 9.0, 9.0, 9.0, 1, 9.0, 1, 9.0, 30)),     # before the window
                 (1.0, reading(10, 1.0, 0.2, 0.5, 0.1, 8, 0.004, 3, 1.0, 2)),
                 (2.0, reading(20, 2.0, 0.5, 1.0, 0.2, 18, 0.006, 5, 1.6, 4)),
                 (3.0, reading(30, 3.0, 0.6, 1.5, 0.3, 28, 0.010, 9, 3.0, 6)),
                 (9.0, reading(99, 99.0, 9.0, 9.0, 9.0, 99, 9.0, 99, 99.0, 30))]  # after it
    p = h.peaks(1.0, 4.0)["target"]
    assert p["mean_running"] == pytest.approx(4.0) and p["steps"] == 20
    assert p["target_factor"] == pytest.approx((2.0 - 0.4) / 1.0)
    assert p["draft_factor"] == pytest.approx(0.4 / 0.2)
    assert p["loop_gap_ms"] == pytest.approx(0.006 / 20 * 1e3)
    assert p["engine_request_s"] == pytest.approx(2.0 / 6)
    # one reading: no differences, nothing claimed
    h.samples = h.samples[1:2]
    q = h.peaks(1.0, 4.0)["target"]
    assert q["target_factor"] is None and q["loop_gap_ms"] is None and q["engine_request_s"] is None


def test_bench_serve_draws_traffic_the_repo_did_not_write():
    """`--mix random=1,long=1`: random-word prompts of 48 words, and long prompts (600 words and
    more, from the repo's prompts) whose answers are an eighth of the mean; the same draws for
    every policy of a repeat (a seeded workload), each opening with a number no other request
    has, so none finds another's prompt in the prefix cache (red without it: 200 draws from 64
    long prompts repeat, and a repeat's second policy would reuse the first one's prefill)."""
    from cluster.bench.client import Workload
    from cluster.bench.serve import PROMPTS_DIR, load_prompts

    prompts = load_prompts(PROMPTS_DIR, ["random", "long", "code"])
    assert all(len(p.split()) == 48 for p in prompts["random"])
    assert min(len(p.split()) for p in prompts["long"]) >= 600
    written = {p for ps in load_prompts(PROMPTS_DIR, ["code", "prose", "chat"]).values() for p in ps}
    assert not set(prompts["random"]) & written
    draws = [Workload(prompts, {"random": 1, "long": 1}, 64, 0.0, seed=3).draw() for _ in range(2)]
    bodies = [d.text.split(": ", 1) for d in draws]
    assert (draws[0].prompt_class, draws[0].max_tokens) == (draws[1].prompt_class,
                                                           draws[1].max_tokens)
    assert bodies[0][1] == bodies[1][1] and bodies[0][0] != bodies[1][0]
    w = Workload(prompts, {"random": 1, "long": 1}, 64, 0.0, seed=3)
    lengths, openings = {}, set()
    for _ in range(200):
        p = w.draw()
        lengths.setdefault(p.prompt_class, set()).add(p.max_tokens)
        openings.add(p.text[:64])
    assert lengths == {"random": {64}, "long": {8}}
    assert len(openings) == 200
    code = Workload(prompts, {"code": 1}, 64, 0.0, seed=3).draw().text
    assert code in prompts["code"]                # the repo's own prompts are sent as written
    with pytest.raises(ValueError, match="no prompts for class 'nope'"):
        load_prompts(PROMPTS_DIR, ["nope"])


def test_bench_serve_traffic_shifts_after_its_delay():
    """`--shift S:MIX`: the first S seconds from the first draw come from the mix, then from
    MIX (a drift the alignment loop should follow)."""
    import time

    from cluster.bench.client import Workload
    from cluster.bench.serve import PROMPTS_DIR, load_prompts

    prompts = load_prompts(PROMPTS_DIR, ["code", "prose"])
    w = Workload(prompts, {"code": 1}, 16, 0.0, seed=1, shift=(0.3, {"prose": 1}))
    before = {w.draw().prompt_class for _ in range(20)}
    time.sleep(0.35)
    after = {w.draw().prompt_class for _ in range(20)}
    assert (before, after) == ({"code"}, {"prose"})
    with pytest.raises(ValueError, match="selects no prompts"):
        Workload(prompts, {"code": 1}, 16, 0.0, seed=1, shift=(1.0, {"nope": 1}))
