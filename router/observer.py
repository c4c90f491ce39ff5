"""The way back up: replicas' `EngineStats` and finished requests in, the policy's `ClusterStats` out.

One observer per router. The live ingress feeds it from the stats Serve carries to its request
routers (`router/live_stats.py`); the capacity simulator feeds it from its simulated replicas
(`cluster/sim/`). Both then call `choose_tier(request, observer.cluster_stats(), state)`, so the
simulator's policy sees exactly what a live router could see, never the simulator's true numbers.

  report(replica_id, EngineStats, kind)     a replica's latest stats (kind: target | small)
  finished(tier, prompt_class, outcome)     a request ended: acceptance per prompt class (the
                                            one estimator, engine/acceptance.py), recent
                                            acceptance samples and output lengths
  cluster_stats() -> ClusterStats           each tier as its next replica (the least loaded)
                                            will meet a new request

Pure Python: no torch, no Ray. Decides nothing (that is `router/policy.py`) and does not price
anything (that is `router/billing.py` and `router/accounting.py`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields, replace
from statistics import median

from engine.acceptance import CLASS_DECAY, CLASS_PRIOR_TRIALS, MIN_SAMPLE_TRIALS, AcceptanceEstimate
from engine.outputs import EngineStats
from router.draft_live import DraftSample, DraftWindows
from router.stats import PROMPT_CLASSES, ClusterStats, TierStats

RECENT_REQUESTS = 256        # finished requests behind the acceptance samples and mean lengths
# The draft's price factor a replica learnt (`CalibratedCost.spec_scale`) as the policy sees it:
# the median of what the replica reported over its last PRICE_WINDOW_S seconds. The engine
# relearns it every few drafting steps (its own k choice wants that), so under serving it swings
# within seconds while acceptance holds; a tier decision binds a request for seconds, and one
# spike must not send whole seconds of requests the wrong way
# (docs/decisions/0017-tier-policy.md).
PRICE_WINDOW_S = 30.0
PRICE_SAMPLES = 256


@dataclass(frozen=True)
class RequestOutcome:
    """What a finished request tells the observer."""

    prompt_tokens: int
    output_tokens: int
    accepted_tokens: int = 0     # draft tokens accepted over the whole request
    draft_trials: int = 0        # draft tokens tried (accepted + rejections); 0: never drafted
    draft: str | None = None     # the draft it ran with (None: none, or swapped while it ran)
    seconds: float = 0.0         # from admission to its last token
    time: float = 0.0            # when it finished


class Observer:
    def __init__(self, default_acceptance: float = 0.6, kinds: tuple[str, ...] = ("target", "small"),
                 scales_to_zero: frozenset[str] = frozenset()):
        self.default_acceptance = default_acceptance
        self.scales_to_zero = scales_to_zero     # kinds whose autoscaler may leave no replica
        self.replicas: dict[str, dict[str, EngineStats]] = {k: {} for k in kinds}
        self.num_queued: dict[str, int] = {k: 0 for k in kinds}   # held by this caller, unsent
        self.by_class: dict[str, AcceptanceEstimate] = {}
        self.samples: deque[float] = deque(maxlen=RECENT_REQUESTS)
        self.output_lengths: deque[int] = deque(maxlen=RECENT_REQUESTS)
        self.prices: dict[tuple[str, str], deque] = {}     # (kind, replica) -> (time, spec_scale)
        self.seen: dict[str, bool] = {}     # kind -> a replica of it has reported (it has started)
        self.drafts = DraftWindows()        # per draft and class, for the alignment loop

    # -- in -----------------------------------------------------------------------------------
    def report(self, replica_id: str, stats: EngineStats, kind: str = "target") -> None:
        self.replicas.setdefault(kind, {})[replica_id] = stats
        self.seen[kind] = True
        if stats.cost is not None:
            seen = self.prices.setdefault((kind, replica_id), deque(maxlen=PRICE_SAMPLES))
            if not seen or stats.time > seen[-1][0]:         # a new report, not a repeat
                seen.append((stats.time, stats.cost.spec_scale))

    def retain(self, kind: str, replica_ids) -> None:
        """Forget the replicas of `kind` not in replica_ids (gone, or their stats went stale)."""
        keep = set(replica_ids)
        gone = set(self.replicas.get(kind, {})) - keep
        self.replicas[kind] = {r: s for r, s in self.replicas.get(kind, {}).items() if r in keep}
        for r in gone:
            self.prices.pop((kind, r), None)

    def queued(self, kind: str, n: int) -> None:
        self.num_queued[kind] = n

    def finished(self, tier: str, prompt_class: str, outcome: RequestOutcome) -> None:
        if tier != "small":
            self.output_lengths.append(outcome.output_tokens)
        if tier != "speculative" or outcome.draft_trials <= 0:
            return
        estimate = self.by_class.get(prompt_class)
        if estimate is None:
            estimate = AcceptanceEstimate(self._prior(), CLASS_PRIOR_TRIALS, CLASS_DECAY)
            self.by_class[prompt_class] = estimate
        estimate.observe(outcome.accepted_tokens, outcome.draft_trials)
        if outcome.draft:
            self.drafts.add(outcome.draft, prompt_class, DraftSample(
                outcome.time, outcome.accepted_tokens, outcome.draft_trials,
                outcome.output_tokens, outcome.seconds))
        if outcome.draft_trials >= MIN_SAMPLE_TRIALS:
            self.samples.append(outcome.accepted_tokens / outcome.draft_trials)

    def draft_swapped(self) -> list[str]:
        """A new draft serves: what was learnt about the old one no longer holds."""
        old = sorted(self.by_class)
        self.by_class.clear()
        self.samples.clear()
        return old

    # -- out ----------------------------------------------------------------------------------
    def next_replica(self, kind: str) -> EngineStats | None:
        """The replica a new request goes to: available ones first, then the least loaded."""
        return min(self.replicas.get(kind, {}).values(),
                   key=lambda s: (not s.available, s.load, -s.kv_headroom_bytes), default=None)

    def lost(self, kind: str) -> bool:
        """The tier had replicas and none reports now (their node or process is gone, or the
        reports are older than the stats' `stale_after_s`), and it does not scale to zero (a
        replica of that is started on demand: a call waits for it)."""
        return (self.seen.get(kind, False) and not self.replicas.get(kind)
                and kind not in self.scales_to_zero)

    def acceptance_by_class(self, learnt_only: bool = False) -> dict[str, float]:
        """Per-token a by prompt class: learnt from finished requests, else the engine's live a."""
        live = self.next_replica("target")
        fallback = live.token_acceptance if live is not None and not learnt_only else None
        out = {name: e.value for name, e in self.by_class.items()}
        if fallback is not None:
            for name in PROMPT_CLASSES:
                out.setdefault(name, fallback)
        return out

    def cluster_stats(self) -> ClusterStats:
        target = self._tier("target")
        tiers = {"speculative": target, "baseline": target}
        if "small" in self.replicas:
            tiers["small"] = self._tier("small")
        return ClusterStats(tiers)

    def health(self, profile: bool = False) -> dict:
        """Per tier: replicas, load, KV bytes held, live acceptance and the prefix cache's hits
        (for `/health`); with
        `profile`, also the step-cost profile the tier's engine runs on."""
        return {kind: _tier_health(replicas, profile) for kind, replicas in self.replicas.items()}

    def _cost(self, kind: str, replica_id: str, s: EngineStats):
        """The replica's cost with its draft price factor at the median of its recent reports."""
        seen = self.prices.get((kind, replica_id))
        if s.cost is None or not seen:
            return s.cost
        recent = [scale for t, scale in seen if t >= seen[-1][0] - PRICE_WINDOW_S]
        scale = median(recent)
        return s.cost if scale == s.cost.spec_scale else replace(s.cost, spec_scale=scale)

    def _prior(self) -> float:
        live = self.next_replica("target")
        return live.token_acceptance if live and live.token_acceptance is not None else self.default_acceptance

    def _tier(self, kind: str) -> TierStats:
        queued = self.num_queued.get(kind, 0)
        s = self.next_replica(kind)
        if s is None:       # none known: none yet (starting), or every one gone (or cold)
            cold = kind in self.scales_to_zero
            return TierStats(queue_depth=queued, cold=cold,
                             available=not cold and not self.seen.get(kind, False))
        replica_id = next(r for r, x in self.replicas[kind].items() if x is s)
        draft_kv = s.draft_kv_bytes_per_token if kind == "target" else 0.0
        n = len(self.output_lengths)
        return TierStats(
            decode_batch_size=s.num_running, num_speculating=min(s.num_speculative, s.num_running),
            speculating_acceptance=tuple(s.speculating_acceptance),
            queue_depth=s.num_waiting + queued,
            kv_headroom_bytes=s.kv_headroom_bytes, kv_budget_bytes=s.kv_budget_bytes,
            target_kv_bytes_per_token=s.target_kv_bytes_per_token,
            draft_kv_bytes_per_token=draft_kv, context_tokens=s.context_tokens,
            acceptance_by_class=self.acceptance_by_class() if kind == "target" else {},
            acceptance_samples=tuple(self.samples),
            mean_output_tokens=sum(self.output_lengths) / n if n else 0.0,
            cost=self._cost(kind, replica_id, s) if draft_kv > 0 else None,
            drafting_loses=s.drafting_pays is False, available=s.available)


def _tier_health(replicas: dict, profile: bool = False) -> dict:
    """One tier's replicas, load, KV bytes held (target, draft) and live per-token acceptance:
    read-only numbers for `specserve bench serve` and operators. `profile`: also the profiled
    step cost (`cost_profile`, the first replica's base model as JSON) that
    `simulate --scenario local-cpu` times its replicas with."""
    reps = list(replicas.values())
    acc = [r.token_acceptance for r in reps if r.token_acceptance is not None]
    headroom = [r.kv_headroom_bytes / r.kv_budget_bytes for r in reps if r.kv_budget_bytes > 0]
    costs = [r.cost for r in reps if r.cost is not None]
    return {"replicas": len(reps), "running": sum(r.num_running for r in reps),
            "waiting": sum(r.num_waiting for r in reps),
            "kv_headroom": round(max(headroom, default=1.0), 4), "replica_ids": list(replicas),
            # each replica's own load (`specserve status` shows it beside Serve's replica states)
            "per_replica": {rid: {"running": r.num_running, "waiting": r.num_waiting,
                                  "kv_headroom": round(r.kv_headroom_bytes / r.kv_budget_bytes, 4)
                                  if r.kv_budget_bytes > 0 else 1.0,
                                  "available": r.available, "draft": r.draft}
                            for rid, r in replicas.items()},
            "kv_budget_bytes": sum(r.kv_budget_bytes for r in reps),
            "kv_used_target_bytes": sum(r.kv_used_target_bytes for r in reps),
            "kv_used_draft_bytes": sum(r.kv_used_draft_bytes for r in reps),
            "kv_peak_target_bytes": sum(max(r.kv_peak_target_bytes, r.kv_used_target_bytes) for r in reps),
            "kv_peak_draft_bytes": sum(max(r.kv_peak_draft_bytes, r.kv_used_draft_bytes) for r in reps),
            "token_acceptance": sum(acc) / len(acc) if acc else None,
            # prompt tokens looked up in the replicas' prefix caches and found there, since start
            "prefix_cache_queries": sum(r.prefix_cache_queries for r in reps),
            "prefix_cache_hits": sum(r.prefix_cache_hits for r in reps),
            "prefix_cache_hit_rate": _ratio(sum(r.prefix_cache_hits for r in reps),
                                            sum(r.prefix_cache_queries for r in reps)),
            # what the replicas learnt while serving beyond their profiled step cost (the
            # per-sequence overhead and the draft's price factor): `simulate --scenario local-cpu`
            # times its replicas with them
            "cost_per_seq_ms": sum(c.per_seq_s for c in costs) / len(costs) * 1e3 if costs else None,
            "cost_spec_scale": sum(c.spec_scale for c in costs) / len(costs) if costs else None,
            # steps against their profile, the loop's gaps, requests' time in the engine
            # (cumulative, summed over the replicas; engine.metrics.ServingTimes)
            "serving": _sum_serving([r.serving for r in reps if r.serving is not None]),
            **({"cost_profile": costs[0].base.to_dict()}
               if profile and costs and hasattr(costs[0].base, "to_dict") else {})}


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _sum_serving(records: list) -> dict | None:
    if not records:
        return None
    names = [f.name for f in fields(records[0]) if not f.name.startswith("_")]
    return {name: sum(getattr(r, name) for r in records) for name in names}
