"""The replica-side metrics, exported through `ray.serve.metrics` (Ray's metrics port, `ray_`).

Names follow vLLM's where one exists (`vllm:spec_decode_num_drafts` -> `specserve_spec_decode_
num_drafts`; Ray allows no `:`). Counters are exported with a `_total` suffix. Owns turning
the engine's cumulative `MetricsSnapshot` into counter increments (the difference since the
last export) and its `EngineStats` into gauges, and the latency histograms. Does not own what
the engine counts (`engine/metrics.py`) nor the ingress's request and tier-decision counters
(`router/ingress.py`).

| metric | type | tags |
| --- | --- | --- |
| specserve_spec_decode_num_drafts | counter | tier_kind |
| specserve_spec_decode_num_draft_tokens | counter | tier_kind |
| specserve_spec_decode_num_accepted_tokens | counter | tier_kind |
| specserve_spec_decode_num_accepted_tokens_per_pos | counter | tier_kind, position |
| specserve_spec_decode_num_emitted_tokens | counter | tier_kind |
| specserve_goodput_tokens_per_second | gauge | tier_kind |
| specserve_num_requests_running / _waiting / specserve_num_requests_speculative | gauge | tier_kind |
| specserve_kv_cache_used_bytes | gauge | tier_kind, model (target, draft) |
| specserve_kv_cache_budget_bytes | gauge | tier_kind |
| specserve_num_preemptions, specserve_num_spec_downgrades | counter | tier_kind |
| specserve_prefix_cache_queries, specserve_prefix_cache_hits | counter | tier_kind |
| specserve_time_to_first_token_seconds | histogram | tier |
| specserve_inter_token_latency_seconds | histogram | tier |
"""

from __future__ import annotations

import math
import time
from collections import deque
from pathlib import Path

from ray.serve import metrics

LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]

_COUNTERS = {   # MetricsSnapshot field -> (metric name, description)
    "num_drafts": ("specserve_spec_decode_num_drafts", "Speculative steps (one per sequence and step with k > 0)."),
    "num_draft_tokens": ("specserve_spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "num_accepted_tokens": ("specserve_spec_decode_num_accepted_tokens", "Draft tokens accepted by the target."),
    "num_emitted_tokens": ("specserve_spec_decode_num_emitted_tokens", "Tokens emitted (accepted + recovered or bonus, and plain decode)."),
    "num_preemptions": ("specserve_num_preemptions", "Sequences preempted for lack of KV."),
    "num_spec_downgrades": ("specserve_num_spec_downgrades", "Sequences dropped from speculation to k = 0 under memory pressure."),
    "num_failed_steps": ("specserve_num_failed_steps", "Engine steps whose requests ended with an error."),
    "num_draft_failures": ("specserve_num_draft_failures", "Steps where the draft failed (its sequences went on in baseline)."),
}


_STATS_COUNTERS = {   # EngineStats field (cumulative) -> (metric name, description), as vLLM's
    "prefix_cache_queries": ("specserve_prefix_cache_queries",
                             "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("specserve_prefix_cache_hits",
                          "Prompt tokens found in the prefix cache (their prefill skipped)."),
}


class RecentTimes:
    """Durations observed in the last `window_s` seconds, for a percentile of them (the p95
    time to first token a replica reports to Serve's autoscaler, router/autoscaling.py)."""

    def __init__(self, window_s: float = 30.0, max_kept: int = 4096):
        self.window_s = window_s
        self._times: deque[tuple[float, float]] = deque(maxlen=max_kept)  # (when, duration)

    def add(self, now: float, value: float) -> None:
        """On every stream's first token: O(1), the oldest dropped past `max_kept`."""
        self._times.append((now, value))

    def percentile(self, now: float, q: float = 0.95) -> float | None:
        """The q-quantile (nearest rank) of what was observed within the window; None: none."""
        while self._times and now - self._times[0][0] > self.window_s:
            self._times.popleft()
        if not self._times:
            return None
        values = sorted(v for _, v in self._times)
        return values[max(0, math.ceil(q * len(values)) - 1)]


class ReplicaMetrics:
    """Serve metrics of one tier replica; call `export(engine)` every second or so."""

    def __init__(self, tier_kind: str):
        import ray

        self.tier_kind = tier_kind
        self.recent_ttft = RecentTimes()
        # Outside a Ray worker (the class used in a plain process, as in tests) a metric call
        # would start a Ray instance of its own: there, record nothing.
        self.enabled = ray.is_initialized()
        if not self.enabled:
            self.ttft = self.itl = _NullHistogram()
            return
        tags = ("tier_kind",)
        self._counters = {field: metrics.Counter(name, description=desc, tag_keys=tags)
                          for field, (name, desc) in _COUNTERS.items()}
        self._stats_counters = {field: metrics.Counter(name, description=desc, tag_keys=tags)
                                for field, (name, desc) in _STATS_COUNTERS.items()}
        self._per_pos = metrics.Counter(
            "specserve_spec_decode_num_accepted_tokens_per_pos",
            description="Accepted draft tokens by position in the draft (0 = first).",
            tag_keys=("tier_kind", "position"))
        self._goodput = metrics.Gauge("specserve_goodput_tokens_per_second",
                                      description="Emitted tokens per second over the last export period.",
                                      tag_keys=tags)
        self._running = metrics.Gauge("specserve_num_requests_running",
                                      description="Sequences in the running batch.", tag_keys=tags)
        self._waiting = metrics.Gauge("specserve_num_requests_waiting",
                                      description="Sequences waiting for admission (queue depth).",
                                      tag_keys=tags)
        self._speculative = metrics.Gauge("specserve_num_requests_speculative",
                                          description="Running sequences in speculative mode.",
                                          tag_keys=tags)
        self._kv_used = metrics.Gauge("specserve_kv_cache_used_bytes",
                                      description="KV bytes held, by model (target, draft).",
                                      tag_keys=("tier_kind", "model"))
        self._draft_info = metrics.Gauge("specserve_draft_info", description="1 for the draft "
                                         "this replica serves (its folder's name), 0 for one it "
                                         "served before", tag_keys=("tier_kind", "draft"))
        self._draft: str | None = None
        self._kv_budget = metrics.Gauge("specserve_kv_cache_budget_bytes",
                                        description="The replica's KV budget in bytes.", tag_keys=tags)
        self.ttft = metrics.Histogram("specserve_time_to_first_token_seconds",
                                      description="Time from arrival at the replica to the first token.",
                                      boundaries=LATENCY_BUCKETS, tag_keys=("tier",))
        self.itl = metrics.Histogram("specserve_inter_token_latency_seconds",
                                     description="Time between consecutive streamed tokens.",
                                     boundaries=LATENCY_BUCKETS, tag_keys=("tier",))
        self._last: dict[str, int] = {}
        self._last_per_pos: list[int] = []
        self._last_time = time.monotonic()

    def export(self, stats, snapshot) -> None:
        """Push engine stats (gauges) and the counters' growth since the last call."""
        if not self.enabled:
            return
        tags = {"tier_kind": self.tier_kind}
        now = time.monotonic()
        for source, counters in ((snapshot, self._counters), (stats, self._stats_counters)):
            for field, counter in counters.items():
                value = int(getattr(source, field, 0) or 0)
                delta = value - self._last.get(field, 0)
                if delta > 0:
                    counter.inc(delta, tags=tags)
                self._last[field] = value
        per_pos = list(getattr(snapshot, "num_accepted_tokens_per_pos", []) or [])
        for pos, value in enumerate(per_pos):
            delta = value - (self._last_per_pos[pos] if pos < len(self._last_per_pos) else 0)
            if delta > 0:
                self._per_pos.inc(delta, tags={**tags, "position": str(pos)})
        self._last_per_pos = per_pos
        emitted_delta = self._last.get("num_emitted_tokens", 0) - self._last.get("_emitted_prev", 0)
        self._last["_emitted_prev"] = self._last.get("num_emitted_tokens", 0)
        self._goodput.set(emitted_delta / max(now - self._last_time, 1e-6), tags=tags)
        self._last_time = now
        self._running.set(stats.num_running, tags=tags)
        self._waiting.set(stats.num_waiting, tags=tags)
        self._speculative.set(getattr(stats, "num_speculative", 0), tags=tags)
        self._kv_used.set(stats.kv_used_target_bytes, tags={**tags, "model": "target"})
        self._kv_used.set(stats.kv_used_draft_bytes, tags={**tags, "model": "draft"})
        self._kv_budget.set(stats.kv_budget_bytes or 0, tags=tags)
        draft = getattr(stats, "draft", None)
        if draft != self._draft and self._draft:
            self._draft_info.set(0, tags={**tags, "draft": Path(self._draft).name})
        self._draft = draft
        if draft:
            self._draft_info.set(1, tags={**tags, "draft": Path(draft).name})


class _NullHistogram:
    def observe(self, value: float, tags: dict | None = None) -> None:
        pass
