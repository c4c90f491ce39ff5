"""What a `specserve bench serve` JSON says the served target measured of itself, window by
window, for `specserve simulate --scenario local-cpu` (`cluster/sim/local.py`): what its steps
took against their profile's prices (`engine.metrics.ServingTimes`), its loop's time between
steps, the serving path's time a request, its live acceptance, and (from older JSON) its cost
calibration's last readings; batch by batch, and at the level of one window.
"""

from __future__ import annotations

import math
import statistics

SPECULATING = ("premium", "always-adaptive")     # bench policies whose every request drafts
DRAFTING = ("auto", *SPECULATING)                 # ... and those whose requests may draft


class ByBatch:
    """A value the served engine learnt at several batch sizes ({batch: value}), read at any
    batch: linear between the batches seen, the nearest one's outside them."""

    def __init__(self, points):
        self.points = sorted((int(n), float(v)) for n, v in points.items())

    def __call__(self, n: float) -> float:
        pts = self.points
        if n <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        for (n0, v0), (n1, v1) in zip(pts, pts[1:]):
            if n <= n1:
                return v0 + (v1 - v0) * (n - n0) / (n1 - n0)
        return pts[-1][1]


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _target(run: dict) -> dict:
    return run.get("health_peaks", {}).get("target", {})


def _window_values(run: dict) -> dict:
    """One window's readings of the target replica (see `bench_learnt`)."""
    t = _target(run)
    e2e, engine = run.get("e2e_s", {}).get("mean"), t.get("engine_request_s")
    return {"per_seq_ms": t.get("cost_per_seq_ms"), "spec_scale": t.get("cost_spec_scale"),
            "target_factor": t.get("target_factor"), "draft_factor": t.get("draft_factor"),
            "gap_ms": t.get("loop_gap_ms"),
            "path_s": max(0.0, e2e - engine) if e2e is not None and engine is not None else None}


def bench_path(bench: dict, policy: str, load_kind: str, load: float) -> float:
    """The serving path's time a request (HTTP, router, Ray) in the windows at this load of
    the policy and those sharing its engine state (median; 0 where not measured)."""
    kin = DRAFTING if policy in DRAFTING else (policy,)
    return _median(_window_values(r)["path_s"] for r in bench.get("runs", [])
                   if r["policy"] in kin and r.get("load_kind") == load_kind
                   and float(r.get("load", -1)) == float(load)) or 0.0


def window_level(bench: dict, learnt: dict, policy: str, load_kind: str, load: float) -> dict:
    """`learnt` (a policy's readings batch by batch, `bench_learnt`) at the level of this
    policy's own windows at this load: each step factor times what those windows read over
    what the batch-by-batch curve gives at their mean batch. The machine's speed drifts
    within a run, up to 2x between windows minutes apart (docs/benchmarks.md, check 1), so
    the curve keeps the shape across batches and the window its level."""
    out = dict(learnt)
    for key in ("target_factor", "draft_factor"):
        if not learnt.get(key):
            continue
        curve = ByBatch(learnt[key])
        own = [(t[key], t.get("mean_running") or t["peak_running"]) for r in bench.get("runs", [])
               if r["policy"] == policy and r.get("load_kind") == load_kind
               and float(r.get("load", -1)) == float(load)
               and (t := _target(r)).get(key) and t.get("peak_running")]
        if own:
            level = statistics.median(v / curve(max(1.0, n)) for v, n in own)
            out[key] = {n: v * level for n, v in learnt[key].items()}
    return out


def _batch_class(running: float) -> int:
    """A window's batch as the power of two nearest its mean (log scale): two windows at
    nearly the same mean batch can read factors far apart (the machine's speed, not the
    batch), and keyed apart they would make a curve that falls steeply within one sequence."""
    return 2 ** max(0, round(math.log2(max(running, 1.0))))


def bench_learnt(bench: dict, policy: str | None = None) -> dict:
    """What the target replica measured of itself while serving, from each window's `/health`
    readings: what its steps took against their profile's prices, target and draft parts
    (`target_factor`, `draft_factor`, over every step of the window; `ServingTimes`), its loop's
    time between steps (`gap_ms`) and the serving path's time a request (`path_s`: the callers'
    mean latency less the engine's mean time for a request); from JSON written before those,
    the calibration's last readings (`per_seq_ms`, `spec_scale`). No policy: medians over the
    runs (the draft's over the runs in which every request drafted). A policy: from that
    policy's runs, as {batch size: median}, the batch the window's mean of running sequences
    (else its peak) to the nearest power of two; for a policy whose requests draft (DRAFTING), from the windows of every
    such policy in which the draft ran (they share one engine state). Each grows or shrinks
    with the batch (the served draft's price factor grows with it:
    docs/decisions/0010-cost-calibration.md)."""
    runs = bench.get("runs", [])
    values = _window_values
    draft_keys = ("spec_scale", "draft_factor")
    if policy is None:
        out = {key: _median(values(r)[key] for r in runs
                            if key not in draft_keys or r["policy"] in SPECULATING)
               for key in values({})}
        return {k: v for k, v in out.items() if v is not None}
    out: dict[str, dict] = {}
    kin = DRAFTING if policy in DRAFTING else (policy,)
    for r in runs:
        t = _target(r)
        if r["policy"] not in kin or not t.get("peak_running"):
            continue
        drafted = bool(t.get("peak_kv_used_draft_bytes"))
        if policy in DRAFTING and not drafted:
            continue
        batch = _batch_class(t.get("mean_running") or t["peak_running"])
        for key, v in values(r).items():
            if v is not None and (drafted or key not in draft_keys):
                out.setdefault(key, {}).setdefault(batch, []).append(v)
    return {k: {n: statistics.median(vs) for n, vs in sorted(v.items())} for k, v in out.items()}


def bench_acceptance(bench: dict) -> float | None:
    """The target's live per-token acceptance that /health reported in the runs in which every
    request drafted, else in those of any policy whose requests may draft (auto) where the
    draft ran."""
    runs = bench.get("runs", [])
    return (_median(_target(r).get("mean_token_acceptance") for r in runs if r["policy"] in SPECULATING)
            or _median(_target(r).get("mean_token_acceptance") for r in runs
                       if r["policy"] in DRAFTING and _target(r).get("peak_kv_used_draft_bytes")))
