"""`specserve bench ramp`'s schedule and report (the served run is a benchmark, not a test)."""

from cluster.bench.ramp import report, users_at


def test_the_ramp_rises_to_its_peak_and_falls_back_to_one():
    users = [users_at(t, 600, 16) for t in range(0, 700, 10)]
    assert users[0] == 1 and users[30] == 16 and users[60] == 1 and users[-1] == 1
    assert users[:31] == sorted(users[:31]) and users[30:61] == sorted(users[30:61], reverse=True)


def test_the_report_counts_errors_besides_429_and_missing_ledger_records():
    ok = {"status": 200, "id": "cmpl-1", "tier": "small", "retry_after": None}
    results = [ok, {**ok, "id": "cmpl-2", "tier": "speculative"},
               {"status": 429, "id": None, "tier": None, "retry_after": "1"},
               {"status": 503, "id": None, "tier": None, "retry_after": None}]
    timeline = [{"replicas": {"TargetServer": 1, "SmallServer": 1}},
                {"replicas": {"TargetServer": 2, "SmallServer": 3}},
                {"replicas": {"TargetServer": 1, "SmallServer": 1}}]
    out = report(results, timeline, {"cmpl-1"})
    assert out["errors_besides_429"] == 1 and out["429_without_retry_after"] == 0
    assert (out["responses_with_id"], out["ledger_records_found"]) == (2, 1)
    assert out["peak_replicas"] == {"TargetServer": 2, "SmallServer": 3}
    assert out["replicas_at_end"] == {"TargetServer": 1, "SmallServer": 1}
