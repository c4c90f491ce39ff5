"""The statistics of `specserve bench serve`: one record per HTTP request, and what a window of
records says (throughput, latency percentiles, SLO attainment, goodput, tiers, errors).

Terms (as vLLM's and DistServe's benchmarks use them):
  TTFT   time from sending the request to the first streamed token.
  TPOT   time per output token after the first: (last token - first token) / (tokens - 1).
  E2E    time from sending the request to its last byte.
  SLO    a request meets it when it succeeded, TTFT <= ttft_s and TPOT <= tpot_s (a one-token
         answer has no TPOT and is judged on TTFT alone).
  attainment  requests meeting the SLO / requests issued (errors count as misses).
  goodput     requests (and their output tokens) meeting the SLO, per second of window.
Throughput counts the output tokens streamed inside the window [start, end), whenever their
request began, so requests spanning the window's edges neither inflate nor deflate it. Latencies
are over the requests issued inside the window (warm-up requests are excluded; requests still
running at the window's end are waited for). Owns arithmetic only: no HTTP, no asyncio.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field

PERCENTILES = (50, 95, 99)
# two-sided 95% Student t quantiles by degrees of freedom (1..9); 1.96 beyond
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


@dataclass
class RequestRecord:
    """What one request did, as the client saw it (times from time.monotonic())."""
    policy: str
    prompt_class: str
    sent: float
    status: int | str = 0                  # HTTP status; 'stream_error' or an exception name
    finished: float | None = None
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens)
    prompt_tokens: int = 0
    completion_tokens: int = 0             # from usage
    tier: str | None = None
    reason: str | None = None
    acceptance_rate: float | None = None   # accepted / drafted, from usage
    mean_acceptance_length: float | None = None
    error: str | None = None
    # what was streamed (a chat's next turn resends the text; identity checks compare the ids)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)    # a chat's, when asked for

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.finished is not None

    @property
    def streamed_tokens(self) -> int:
        return sum(n for _, n in self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0][0] - self.sent if self.token_times else None

    @property
    def tpot(self) -> float | None:
        n = self.streamed_tokens
        if n < 2:
            return None
        return (self.token_times[-1][0] - self.token_times[0][0]) / (n - 1)

    @property
    def e2e(self) -> float | None:
        return self.finished - self.sent if self.finished is not None else None


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 1.0
    tpot_s: float = 0.1

    def met(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft is None or r.ttft > self.ttft_s:
            return False
        tpot = r.tpot
        return tpot is None or tpot <= self.tpot_s


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between order statistics (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict:
    out = {"mean": statistics.fmean(values) if values else None, "n": len(values)}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return out


def tokens_in_window(records: list[RequestRecord], start: float, end: float) -> int:
    return sum(n for r in records for t, n in r.token_times if start <= t < end)


def summarize(windows: list[tuple[list[RequestRecord], float, float]], slo: SLO) -> dict:
    """The numbers of one or more windows (repeats), pooled: rates over the summed window time,
    percentiles over every request. Each window is (every record of its run, start, end)."""
    window = sum(end - start for _, start, end in windows)
    issued = [r for recs, start, end in windows for r in recs if start <= r.sent < end]
    ok = [r for r in issued if r.ok]
    met = [r for r in ok if slo.met(r)]
    tokens = sum(tokens_in_window(recs, start, end) for recs, start, end in windows)
    finished = sum(1 for recs, start, end in windows for r in recs
                   if r.ok and start <= r.finished < end)
    tiers = Counter(r.tier for r in ok)
    reasons = Counter(f"{r.tier}:{r.reason}" for r in ok)
    spec = [r for r in ok if r.acceptance_rate is not None]
    spec_tokens = sum(r.completion_tokens for r in spec)
    return {
        "window_s": window,
        "requests_issued": len(issued),
        "requests_ok": len(ok),
        "output_tokens_in_window": tokens,
        "output_tok_s": tokens / window,
        "requests_per_s": finished / window,
        "completion_tokens_usage": sum(r.completion_tokens for r in ok),
        "completion_tokens_streamed": sum(r.streamed_tokens for r in ok),
        "prompt_tokens_usage": sum(r.prompt_tokens for r in ok),
        "ttft_s": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": distribution([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": distribution([r.e2e for r in ok]),
        "slo_attainment": len(met) / len(issued) if issued else None,
        "goodput_requests_per_s": len(met) / window,
        "goodput_tok_s": sum(r.completion_tokens for r in met) / window,
        "tier_shares": {t: n / len(ok) for t, n in sorted(tiers.items())} if ok else {},
        "reasons": dict(sorted(reasons.items())),
        # token-weighted mean of each request's accepted / drafted (usage), speculative ones
        "acceptance_rate": (sum(r.acceptance_rate * r.completion_tokens for r in spec) / spec_tokens
                            if spec_tokens else None),
        "mean_acceptance_length": (sum(r.mean_acceptance_length * r.completion_tokens for r in spec
                                       if r.mean_acceptance_length is not None) / spec_tokens
                                   if spec_tokens else None),
        "errors_by_status": dict(sorted(Counter(str(r.status) for r in issued if not r.ok).items())),
    }


def timeline(records: list[RequestRecord], start: float, end: float, bucket_s: float) -> list[dict]:
    """Per `bucket_s` of the run (requests by when they finished, from the window's start; the
    warm-up's buckets have negative starts), per prompt class: requests, token-weighted
    acceptance of the speculative ones, median TPOT; and the failures. Shows what a change in
    the middle of a run (a draft swapped in) did, class by class."""
    first = min((r.sent for r in records), default=start)
    out = []
    t = start - math.ceil((start - first) / bucket_s) * bucket_s
    while t < end:
        done = [r for r in records if r.finished is not None and t <= r.finished < t + bucket_s]
        row = {"t0_s": round(t - start, 3), "failed": sum(1 for r in done if not r.ok), "classes": {}}
        for cls in sorted({r.prompt_class for r in done if r.ok}):
            ok = [r for r in done if r.ok and r.prompt_class == cls]
            spec = [r for r in ok if r.acceptance_rate is not None and r.completion_tokens]
            n = sum(r.completion_tokens for r in spec)
            tpots = [r.tpot for r in ok if r.tpot is not None]
            row["classes"][cls] = {
                "requests": len(ok), "tokens": sum(r.completion_tokens or 0 for r in ok),
                "acceptance_rate": sum(r.acceptance_rate * r.completion_tokens for r in spec) / n if n else None,
                "tpot_p50_s": statistics.median(tpots) if tpots else None}
        out.append(row)
        t += bucket_s
    return out


def mean_ci95(values: list[float]) -> dict:
    """Mean, sample standard deviation and the 95% confidence half-width (Student t)."""
    n = len(values)
    if n == 0:
        return {"mean": None, "std": None, "ci95": None, "n": 0}
    mean = statistics.fmean(values)
    if n == 1:
        return {"mean": mean, "std": None, "ci95": None, "n": 1}
    std = statistics.stdev(values)
    return {"mean": mean, "std": std, "ci95": _T95.get(n - 1, 1.96) * std / math.sqrt(n), "n": n}
