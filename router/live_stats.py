"""Live stats from every tier replica, for the policy, gathered off the request path.

How the numbers travel: each replica's `record_routing_stats()` returns its engine stats; the
Serve controller polls it every `request_routing_stats_period_s` and broadcasts the result to
the request routers of every caller. Serve hands these stats only to a `RequestRouter`, so
`StatsRequestRouter` (configured on the tier deployments) registers itself in this process
and also uses the stats to route (least loaded first). `LiveStats` is a background task in the
ingress that reads the routers every period and keeps one snapshot per tier; a request reads
the snapshot and never waits on a replica.

Owns: the replica stats record, the router, the poller. Does not own the tier decision
(`router/policy.py`) nor what the replicas measure (`deployments/`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

logger = logging.getLogger(__name__)

# (app name, deployment name) -> the request router that a handle in this process created.
_ROUTERS: dict[tuple[str, str], "StatsRequestRouter"] = {}


@dataclass
class ReplicaStats:
    """One replica's engine stats as its `record_routing_stats()` reported them."""
    replica_id: str
    kind: str = "target"                 # target (speculative + baseline) | small
    available: bool = True               # False: its engine loop died (Serve is replacing it)
    time: float = 0.0                    # when the replica measured them (its clock)
    num_running: int = 0
    num_waiting: int = 0
    num_speculative: int = 0
    kv_budget_bytes: int = 0
    kv_used_target_bytes: int = 0
    kv_used_draft_bytes: int = 0
    acceptance_rate: float | None = None       # accepted / drafted (the dashboard's)
    token_acceptance: float | None = None      # the engine's live per-token a
    max_model_len: int = 0
    tp_size: int = 1
    target_kv_bytes_per_token: float = 0.0     # per rank: the target's KV is split over tp_size
    draft_kv_bytes_per_token: float = 0.0      # 0: no draft
    cost_model: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_routing_stats(cls, replica_id: str, stats: dict) -> "ReplicaStats":
        known = {k: stats[k] for k in cls.__dataclass_fields__ if k in stats and k != "extra"}
        known.setdefault("replica_id", replica_id)
        extra = {k: v for k, v in stats.items() if k not in cls.__dataclass_fields__}
        return cls(**{**known, "replica_id": replica_id}, extra=extra)

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def kv_headroom(self) -> float:
        """Fraction of the KV budget still free (1.0 when unknown)."""
        if self.kv_budget_bytes <= 0:
            return 1.0
        used = self.kv_used_target_bytes + self.kv_used_draft_bytes
        return max(0.0, 1.0 - used / self.kv_budget_bytes)


@dataclass
class TierSnapshot:
    """All live replicas of one deployment at one moment."""
    deployment: str
    replicas: list[ReplicaStats] = field(default_factory=list)
    updated_at: float = 0.0
    num_queued_here: int = 0           # requests queued in this caller's router (not yet sent)

    @property
    def next_replica(self) -> ReplicaStats | None:
        """The replica the router sends the next request to: the least loaded."""
        return min(self.replicas, key=lambda r: (not r.available, r.load, -r.kv_headroom),
                   default=None)

    @property
    def num_running(self) -> int:
        return sum(r.num_running for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    @property
    def kv_headroom(self) -> float:
        """Headroom of the replica with the most room (where the router sends new work)."""
        return max((r.kv_headroom for r in self.replicas), default=1.0)


def _load_key(replica: RunningReplica) -> tuple:
    """Unavailable replicas (engine loop dead, awaiting replacement) last, then least loaded."""
    stats = replica.routing_stats or {}
    used = stats.get("kv_used_target_bytes", 0) + stats.get("kv_used_draft_bytes", 0)
    return (not stats.get("available", True),
            stats.get("num_running", 0) + stats.get("num_waiting", 0), used)


class StatsRequestRouter(FIFOMixin, RequestRouter):
    """Least-loaded-first routing on the replicas' own stats; shares them with `LiveStats`."""

    # Serve ships this class to callers with cloudpickle, by value: its methods then see a
    # copy of this module's globals. So they reach the module itself through the import system.

    def initialize_state(self, **kwargs):
        from router import live_stats

        live_stats._ROUTERS[(self._deployment_id.app_name, self._deployment_id.name)] = self

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        from router.live_stats import _load_key

        ranked = sorted(candidate_replicas, key=_load_key)
        # Serve probes the first group's queue lengths and picks among it; the rest is fallback.
        return [ranked[:2], ranked[2:]] if len(ranked) > 2 else [ranked]

    def replica_stats(self) -> list[ReplicaStats]:
        from router.live_stats import ReplicaStats

        replicas = dict(self.curr_replicas)
        return [ReplicaStats.from_routing_stats(str(rid.unique_id), r.routing_stats or {})
                for rid, r in replicas.items()]

    @property
    def num_queued(self) -> int:
        """Requests this caller holds that no replica has accepted yet."""
        return self.num_pending_requests


class LiveStats:
    """Polls the request routers of the tier handles into per-tier snapshots."""

    def __init__(self, handles: dict, period_s: float = 1.0, stale_after_s: float = 10.0):
        self._handles = handles           # kind ("target" | "small") -> DeploymentHandle
        self._period_s = period_s
        self._stale_after_s = stale_after_s
        self._snapshots: dict[str, TierSnapshot] = {k: TierSnapshot(k) for k in handles}
        self._task: asyncio.Task | None = None
        self._seeded: dict[str, list[ReplicaStats]] = {}

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def snapshot(self, kind: str) -> TierSnapshot:
        return self._snapshots.get(kind) or TierSnapshot(kind)

    def snapshots(self) -> dict[str, TierSnapshot]:
        return dict(self._snapshots)

    async def _run(self) -> None:
        # Serve builds a handle's router on its first call: one cheap call per tier creates it.
        for kind, handle in self._handles.items():
            asyncio.get_running_loop().create_task(self._warm(kind, handle))
        while True:
            try:
                self.poll()
            except Exception:   # never let a stats hiccup kill the poller
                logger.exception("live stats poll failed")
            await asyncio.sleep(self._period_s)

    async def _warm(self, kind: str, handle) -> None:
        for attempt in range(120):
            try:
                first = await handle.ready.remote()
                # Until Serve's first stats broadcast arrives, use what `ready` reported.
                self._seeded[kind] = [ReplicaStats.from_routing_stats("ready", first["stats"])]
                if not self._snapshots[kind].replicas:
                    self._snapshots[kind] = TierSnapshot(kind, self._seeded[kind], time.time())
                return
            except Exception as exc:
                logger.info("waiting for %s replicas (%s)", kind, exc)
                await asyncio.sleep(min(1.0 + attempt, 5.0))

    def poll(self) -> None:
        now = time.time()
        for kind, handle in self._handles.items():
            router = _ROUTERS.get((handle.deployment_id.app_name, handle.deployment_id.name))
            if router is None:
                continue
            replicas = [r for r in router.replica_stats()
                        if r.time and now - r.time < self._stale_after_s]
            if not replicas and self._seeded.get(kind):
                replicas = [r for r in self._seeded[kind] if now - r.time < self._stale_after_s]
            self._snapshots[kind] = TierSnapshot(kind, replicas, now, router.num_queued)


def to_cluster_stats(snapshots: dict[str, TierSnapshot],
                     acceptance_by_class: dict[str, float], recent: dict | None = None):
    """The policy's `ClusterStats` from the snapshots: each tier as seen by its next replica.

    The router sends a new request to the least-loaded replica, so that replica's batch, KV
    headroom and cost are what the request will meet; the queue adds what this caller holds.
    Acceptance is the per-token a throughout (the engine's live estimate, and per prompt class
    from finished requests); `recent` adds the spread of a over recently finished speculative
    requests (`acceptance_samples`) and the recent mean prompt and output lengths.
    """
    import dataclasses

    from engine.cost_model import step_cost_from_dict
    from router.stats import PROMPT_CLASSES, ClusterStats, TierStats

    fields = {f.name for f in dataclasses.fields(TierStats)}

    def tier(snapshot: TierSnapshot, kind: str) -> TierStats:
        r = snapshot.next_replica
        if r is None:
            return TierStats(queue_depth=snapshot.num_queued_here)
        cost = None
        if r.draft_kv_bytes_per_token > 0 and {"target", "draft"} <= set(r.cost_model or {}):
            cost = step_cost_from_dict(r.cost_model)
        by_class = dict(acceptance_by_class)
        if r.token_acceptance is not None:
            for name in PROMPT_CLASSES:
                by_class.setdefault(name, r.token_acceptance)
        num_spec = min(r.num_speculative, r.num_running)
        per_seq = r.token_acceptance if r.token_acceptance is not None else 0.5
        kv_tok = r.target_kv_bytes_per_token
        values = dict(
            decode_batch_size=r.num_running, num_speculating=num_spec,
            speculating_acceptance=(per_seq,) * num_spec,
            queue_depth=r.num_waiting + snapshot.num_queued_here,
            kv_headroom_bytes=max(0, r.kv_budget_bytes - r.kv_used_target_bytes - r.kv_used_draft_bytes),
            kv_budget_bytes=r.kv_budget_bytes, target_kv_bytes_per_token=kv_tok,
            draft_kv_bytes_per_token=r.draft_kv_bytes_per_token if kind == "target" else 0.0,
            context_tokens=int(r.kv_used_target_bytes / kv_tok) if kv_tok else 0,
            acceptance_by_class=by_class, cost=cost, **(recent or {}))
        return TierStats(**{k: v for k, v in values.items() if k in fields})

    target = tier(snapshots["target"], "target")
    tiers = {"speculative": target, "baseline": target}
    if "small" in snapshots:
        tiers["small"] = tier(snapshots["small"], "small")
    return ClusterStats(tiers)
