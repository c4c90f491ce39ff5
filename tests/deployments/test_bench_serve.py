"""`specserve bench serve` against a real local cluster (tiny models): the numbers it writes are
internally consistent, every policy ran on the tier it names, and errors are counted by status.
On the app the tiny fixed-k group shares (tests/app_groups.py)."""

import argparse
import asyncio
import json

import pytest

from serving_helpers import shared_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TIER = {"standard": ("baseline", "plan_standard"), "premium": ("speculative", "plan_premium"),
        "economy": ("small", "plan_economy"), "always-adaptive": ("speculative", "speculation_on")}


@pytest.fixture(scope="module")
def app(module_tmp, tiny_family):
    # Fixed k: the tiny random draft does not pay, and the adaptive engine rightly drafts only
    # in brief probes, which the bench's /health sampling may miss (the draft's KV peak read 0
    # once the engine's calibration stopped overrating drafting). This module tests the bench's
    # numbers, so speculative requests here always draft.
    return shared_app("tiny-fixed-k", module_tmp, tiny_family,
                      target={"engine_args": {"adaptive_k": False}})


def _args(*argv):
    from cluster.bench import serve as bench_serve

    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bench_serve_writes_consistent_numbers(app, tmp_path):
    from cluster.cli import main

    out = tmp_path / "serve"
    rc = main(["bench", "serve", "--url", app.url, "--key", app.keys["auto"],
               "--admin-key", app.admin_key, "--users", "2",
               "--rates", "3", "--warmup-s", "0.5", "--duration-s", "2", "--repeats", "1",
               "--output-tokens", "12", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    results = report["results"]
    assert {(r["policy"], r["load_kind"]) for r in results} == {
        (p, k) for p in ("auto", "premium", "standard", "economy", "always-adaptive")
        for k in ("users", "rate")}
    for r in results + report["runs"]:
        assert r["requests_ok"] > 0 and r["errors_by_status"] == {}
        # token counts: the streamed token ids add up to the responses' usage
        assert r["completion_tokens_usage"] == r["completion_tokens_streamed"] > 0
        assert r["output_tok_s"] == pytest.approx(r["output_tokens_in_window"] / r["window_s"])
        for metric in ("ttft_s", "tpot_s", "e2e_s"):
            d = r[metric]
            assert 0 < d["p50"] <= d["p95"] <= d["p99"]
        assert r["ttft_s"]["p50"] <= r["e2e_s"]["p50"]
        assert 0 <= r["slo_attainment"] <= 1
        assert r["goodput_tok_s"] <= r["completion_tokens_usage"] / r["window_s"] + 1e-9
        assert sum(r["tier_shares"].values()) == pytest.approx(1.0)
        if r["policy"] in TIER:
            tier, reason = TIER[r["policy"]]
            assert r["tier_shares"] == {tier: 1.0}
            assert set(r["reasons"]) == {f"{tier}:{reason}"}
        else:
            assert set(r["tier_shares"]) <= {"speculative", "baseline"}
        speculative = r["tier_shares"].get("speculative", 0) > 0
        assert (r["acceptance_rate"] is not None) == speculative
        if speculative:
            assert 0 <= r["acceptance_rate"] <= 1 and r["mean_acceptance_length"] >= 1
    for r in results:
        if r["load_kind"] == "users" and r["policy"] in ("premium", "always-adaptive"):
            peaks = r["health_peaks"]["target"]
            assert peaks["peak_kv_used_target_bytes"] > 0 and peaks["peak_kv_used_draft_bytes"] > 0
    for r in report["runs"]:        # what the target learnt while serving, for local-cpu
        learnt = r["health_peaks"]["target"]
        assert learnt["cost_per_seq_ms"] >= 0 and learnt["cost_spec_scale"] > 0
    assert len(report["comparison"]) == 2


def test_errors_are_counted_by_status(app):
    from cluster.bench.serve import bench

    # an economy key may not call the premium endpoint: every premium request is a 403
    args = _args("--policies", "premium,economy", "--users", "1", "--warmup-s", "0.5",
                 "--duration-s", "1.5", "--repeats", "1", "--output-tokens", "8")
    report = asyncio.run(bench(app.url, app.keys["economy"], args, progress=False))
    at = {r["policy"]: r for r in report["results"]}
    premium, economy = at["premium"], at["economy"]
    assert premium["requests_ok"] == 0 and premium["requests_issued"] > 0
    assert premium["errors_by_status"] == {"403": premium["requests_issued"]}
    assert premium["slo_attainment"] == 0 and premium["output_tok_s"] == 0
    assert economy["errors_by_status"] == {} and economy["tier_shares"] == {"small": 1.0}
