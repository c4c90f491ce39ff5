"""Rate limits and quotas per plan, shared by every ingress replica through the database.

Per key: requests per minute, tokens per minute and tokens per calendar month (UTC), each
optional (`AppConfig.plans`). Counters are fixed windows in the `rate_windows` table. At
admission one transaction adds 1 request and the request's estimate (prompt + max_tokens) to
the key's minute and month windows and reads the sums back (`RETURNING`); if a sum passes its
limit the transaction rolls back and the caller gets a 429 with `Retry-After` and OpenAI's
`x-ratelimit-*` headers. The row lock (SQLite's write lock, PostgreSQL's row lock) makes
concurrent admissions from several replicas count exactly. When the request's ledger record
reaches the database, `settle` corrects the windows by (actual tokens - reserved) in the same
transaction as the insert, so the correction happens exactly once.
Owns the windows and the headers; does not own plans or keys. No Ray, no torch.
"""

from __future__ import annotations

import calendar
import random
import time
from dataclasses import dataclass, field

from router.store import Database

UPSERT = ("INSERT INTO rate_windows (key_id, win, requests, tokens, expires_at) "
          "VALUES (?, ?, ?, ?, ?) ON CONFLICT (key_id, win) DO UPDATE SET "
          "requests = rate_windows.requests + excluded.requests, "
          "tokens = rate_windows.tokens + excluded.tokens RETURNING requests, tokens")


@dataclass
class Admission:
    allowed: bool
    reserved_tokens: int | None = None          # None: this plan has no limits (nothing counted)
    headers: dict[str, str] = field(default_factory=dict)
    message: str = ""
    code: str = ""


def minute_window(now: float) -> tuple[str, float]:
    start = int(now // 60) * 60
    return f"m{start}", start + 60.0


def month_window(now: float) -> tuple[str, float]:
    t = time.gmtime(now)
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return f"M{t.tm_year:04d}-{t.tm_mon:02d}", float(calendar.timegm((year, month, 1, 0, 0, 0)))


def _reset(seconds: float) -> str:
    """OpenAI's reset format: '12s', '1m30s'."""
    s = max(1, int(seconds + 0.999))
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


class _Refused(Exception):
    def __init__(self, admission: Admission):
        self.admission = admission


class RateLimiter:
    def __init__(self, db: Database, plans: dict):
        self.db = db
        self.plans = {name: limits for name, limits in plans.items()
                      if limits.requests_per_min or limits.tokens_per_min or limits.monthly_tokens}

    def limited(self, plan: str) -> bool:
        return plan in self.plans

    def admit(self, key_id: str, plan: str, tokens: int, now: float) -> Admission:
        """Count one request of `tokens` (estimate) for the key, or refuse it (blocking: the
        ingress calls this in a worker thread)."""
        limits = self.plans.get(plan)
        if limits is None:
            return Admission(True)
        minute, minute_end = minute_window(now)
        month, month_end = month_window(now)
        try:
            with self.db.transaction() as tx:
                requests, used = tx.execute(UPSERT, (key_id, minute, 1, tokens, minute_end)).fetchone()
                headers = {}
                reset = minute_end - now
                if limits.requests_per_min:
                    headers.update({"x-ratelimit-limit-requests": str(limits.requests_per_min),
                                    "x-ratelimit-remaining-requests":
                                        str(max(0, limits.requests_per_min - requests)),
                                    "x-ratelimit-reset-requests": _reset(reset)})
                if limits.tokens_per_min:
                    headers.update({"x-ratelimit-limit-tokens": str(limits.tokens_per_min),
                                    "x-ratelimit-remaining-tokens":
                                        str(max(0, limits.tokens_per_min - used)),
                                    "x-ratelimit-reset-tokens": _reset(reset)})
                if limits.requests_per_min and requests > limits.requests_per_min:
                    raise _Refused(self._refusal(
                        headers, reset, "rate_limit_exceeded",
                        f"rate limit: {limits.requests_per_min} requests per minute on plan "
                        f"'{plan}'; retry in {_reset(reset)}", remaining_requests=requests - 1))
                if limits.tokens_per_min and used > limits.tokens_per_min:
                    raise _Refused(self._refusal(
                        headers, reset, "rate_limit_exceeded",
                        f"rate limit: {limits.tokens_per_min} tokens per minute on plan '{plan}' "
                        f"(this request reserves {tokens}: prompt + max_tokens); retry in "
                        f"{_reset(reset)}", remaining_tokens=used - tokens,
                        remaining_requests=requests - 1))
                _, month_used = tx.execute(UPSERT, (key_id, month, 1, tokens, month_end)).fetchone()
                if limits.monthly_tokens and month_used > limits.monthly_tokens:
                    raise _Refused(self._refusal(
                        headers, month_end - now, "insufficient_quota",
                        f"monthly quota: {limits.monthly_tokens} tokens on plan '{plan}' "
                        f"({month_used - tokens} used); it renews at the start of next month",
                        remaining_requests=requests - 1, remaining_tokens=used - tokens))
        except _Refused as refused:
            return refused.admission
        if random.random() < 0.01:
            self.prune(now)
        return Admission(True, tokens, headers)

    @staticmethod
    def _refusal(headers, retry_s, code, message, remaining_requests=None,
                 remaining_tokens=None) -> Admission:
        """The windows roll back: report what they hold without this request."""
        headers = dict(headers)
        if remaining_requests is not None and "x-ratelimit-limit-requests" in headers:
            headers["x-ratelimit-remaining-requests"] = str(max(
                0, int(headers["x-ratelimit-limit-requests"]) - remaining_requests))
        if remaining_tokens is not None and "x-ratelimit-limit-tokens" in headers:
            headers["x-ratelimit-remaining-tokens"] = str(max(
                0, int(headers["x-ratelimit-limit-tokens"]) - remaining_tokens))
        headers["Retry-After"] = str(max(1, int(retry_s + 0.999)))
        return Admission(False, None, headers, message, code)

    @staticmethod
    def settle(tx, rec) -> None:
        """Ledger insert hook: correct the windows by what the request really used."""
        if rec.reserved_tokens is None:
            return
        delta = rec.prompt_tokens + rec.completion_tokens - rec.reserved_tokens
        if delta:
            for win, _ in (minute_window(rec.started_at), month_window(rec.started_at)):
                tx.execute("UPDATE rate_windows SET tokens = tokens + ? WHERE key_id = ? AND win = ?",
                           (delta, rec.key_id, win))

    def prune(self, now: float) -> None:
        with self.db.transaction() as tx:
            tx.execute("DELETE FROM rate_windows WHERE expires_at < ?", (now - 120,))

    def month_tokens(self, key_id: str, now: float) -> int:
        rows = self.db.query("SELECT tokens FROM rate_windows WHERE key_id = ? AND win = ?",
                             (key_id, month_window(now)[0]))
        return int(rows[0][0]) if rows else 0
