"""Rate limits and quotas per plan on SQLite and PostgreSQL: exact under concurrency, OpenAI
headers, settlement of the reserved tokens when the ledger record lands."""

from __future__ import annotations

import threading
import time

from router.config import PlanLimits
from router.ledger import Ledger
from router.ratelimit import RateLimiter, minute_window, month_window
from router.store import Database

from ledger_helpers import make_record

NOW = 1_699_999_990.0     # 10 s into the minute window that starts at 1_699_999_980


def test_requests_per_minute_exact_across_threads(db_url):
    limiter = RateLimiter(Database(db_url, durable=False), {"standard": PlanLimits(requests_per_min=25)})
    results = []

    def worker():
        for _ in range(10):
            results.append(limiter.admit("key_a", "standard", 3, NOW).allowed)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 25 and len(results) == 60
    refused = limiter.admit("key_a", "standard", 3, NOW)
    assert not refused.allowed and refused.code == "rate_limit_exceeded"
    assert refused.headers["Retry-After"] == "50"
    assert refused.headers["x-ratelimit-limit-requests"] == "25"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"] == "50s"
    assert limiter.admit("key_b", "standard", 3, NOW).allowed        # per key
    assert limiter.admit("key_a", "standard", 3, NOW + 60).allowed   # the next minute


def test_tokens_per_minute_and_settlement(db_url, tmp_path):
    db = Database(db_url)
    limiter = RateLimiter(db, {"auto": PlanLimits(tokens_per_min=100)})
    first = limiter.admit("key_a", "auto", 60, NOW)
    assert first.allowed and first.reserved_tokens == 60
    assert first.headers["x-ratelimit-remaining-tokens"] == "40"
    refused = limiter.admit("key_a", "auto", 60, NOW + 1)
    assert not refused.allowed and refused.headers["x-ratelimit-remaining-tokens"] == "40"
    # The request used 13 + 8 = 21 tokens, not 60: the ledger insert gives back 39.
    ledger = Ledger(db, tmp_path / "spool", on_insert=RateLimiter.settle)
    ledger.record(make_record(0, key_id="key_a", prompt_tokens=13, completion_tokens=8,
                              reserved_tokens=60, started_at=NOW))
    ledger.record(make_record(0, key_id="key_a", prompt_tokens=13, completion_tokens=8,
                              reserved_tokens=60, started_at=NOW))     # a duplicate: once only
    ledger.drain_once()
    again = limiter.admit("key_a", "auto", 60, NOW + 2)
    assert again.allowed and again.headers["x-ratelimit-remaining-tokens"] == str(100 - 21 - 60)


def test_monthly_quota(db_url):
    limiter = RateLimiter(Database(db_url), {"economy": PlanLimits(monthly_tokens=1000)})
    assert limiter.admit("key_a", "economy", 600, NOW).allowed
    refused = limiter.admit("key_a", "economy", 600, NOW + 120)
    assert not refused.allowed and refused.code == "insufficient_quota"
    assert int(refused.headers["Retry-After"]) == int(month_window(NOW)[1] - (NOW + 120) + 0.999)
    assert limiter.admit("key_a", "economy", 400, NOW + 120).allowed
    assert limiter.month_tokens("key_a", NOW) == 1000


def test_unlimited_plans_touch_nothing(tmp_path):
    limiter = RateLimiter(Database(f"sqlite:///{tmp_path}/l.db"), {"premium": PlanLimits()})
    assert not limiter.limited("premium")
    admission = limiter.admit("k", "premium", 10**9, time.time())
    assert admission.allowed and admission.reserved_tokens is None and not admission.headers


def test_windows():
    assert minute_window(NOW) == ("m1699999980", 1_700_000_040.0)
    assert month_window(1_700_000_000.0) == ("M2023-11", 1_701_388_800.0)   # 2023-12-01 UTC
    assert month_window(1_703_980_800.0)[0] == "M2023-12"                     # 2023-12-31
    assert month_window(1_703_980_800.0)[1] == 1_704_067_200.0               # 2024-01-01


def test_threads_opening_a_new_sqlite_file_at_once_all_connect(tmp_path):
    """Each thread opens its own connection, which puts the file in WAL mode. SQLite answers
    "database is locked" at once, without the busy timeout, to a second switch racing the
    first, and a request whose thread meets it fails."""
    errors = []
    for trial in range(30):
        db = Database(f"sqlite:///{tmp_path}/t{trial}.db", durable=False)

        def connect():
            try:
                db._conn()
            except Exception as exc:       # what a request's thread would have raised
                errors.append(repr(exc))
        threads = [threading.Thread(target=connect) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
