"""Live stats from every tier replica, gathered off the request path into the observer.

How the numbers travel: each replica's `record_routing_stats()` returns its engine's
`EngineStats`; the Serve controller polls it every `request_routing_stats_period_s` and
broadcasts it to the request routers of every caller. Serve hands these stats only to a
`RequestRouter`, so `StatsRequestRouter` (configured on the tier deployments) registers itself
in this process and also uses the stats to route (least loaded first). `LiveStats` is a
background task in the ingress that reads the routers every period into a
`router.observer.Observer`; a request reads the observer and never waits on a replica.

Owns: the router and the poller. Does not own the stats record (`engine.outputs.EngineStats`),
what is made of it (`router/observer.py`) nor the tier decision (`router/policy.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from engine.outputs import EngineStats
from router.observer import Observer

logger = logging.getLogger(__name__)

# (app name, deployment name) -> the request router that a handle in this process created.
_ROUTERS: dict[tuple[str, str], "StatsRequestRouter"] = {}
# replica id -> wall time at which it answered a caller in this process that its engine is down
_DOWN: dict[str, float] = {}
DOWN_FORGET_S = 60.0       # a mark older than this is dropped whatever the stats say


def mark_down(replica_id: str, now: float | None = None) -> None:
    """A replica answered that its engine is down: rank it with the unavailable replicas until
    it reports stats taken after that (they say whether it serves again). Its own stats reach the
    routers up to a period late, and Serve breaks a tie of queue lengths by order, so without
    the mark a request sent again would find the same replica."""
    now = time.time() if now is None else now
    for rid in [r for r, since in _DOWN.items() if now - since > DOWN_FORGET_S]:
        del _DOWN[rid]                  # replicas gone for good are never asked about again
    _DOWN[replica_id] = now


def _reported_down(replica: RunningReplica, stats: EngineStats | None,
                   now: float | None = None) -> bool:
    rid = getattr(getattr(replica, "replica_id", None), "unique_id", None)
    since = _DOWN.get(rid)
    if since is None:
        return False
    now = time.time() if now is None else now
    if (stats is not None and stats.time > since) or now - since > DOWN_FORGET_S:
        _DOWN.pop(rid, None)
        return False
    return True


def _stats(replica: RunningReplica) -> EngineStats | None:
    """A replica's last `EngineStats` (Serve's default before the first report is `{}`)."""
    stats = replica.routing_stats
    return stats if isinstance(stats, EngineStats) else None


def _load_key(replica: RunningReplica) -> tuple:
    """Unavailable replicas (engine loop dead, awaiting replacement, or said so to a caller
    here since its last stats) last, then least loaded."""
    from router.live_stats import _reported_down, _stats

    s = _stats(replica)
    down = _reported_down(replica, s)
    if s is None:
        return (down, 0, 0)
    return (down or not s.available, s.load, s.kv_used_target_bytes + s.kv_used_draft_bytes)


def replica_groups(candidates: list) -> list[list]:
    """The groups Serve tries in order: the two least loaded available replicas (Serve probes
    their queues and picks one), the other available ones, then the unavailable ones (their
    engine restarting or dead: they answer 503 with Retry-After at once, so in a group with a
    live replica their empty queue would win every probe)."""
    from router.live_stats import _load_key

    ranked = sorted(candidates, key=_load_key)
    up = [r for r in ranked if not _load_key(r)[0]]
    return [g for g in (up[:2], up[2:], ranked[len(up):]) if g]


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
        from router.live_stats import replica_groups

        return replica_groups(candidate_replicas)

    def replica_stats(self) -> dict[str, EngineStats]:
        """replica id -> its last `EngineStats`, for replicas that reported one."""
        from router.live_stats import _stats

        replicas = dict(self.curr_replicas)
        return {str(rid.unique_id): s for rid, r in replicas.items() if (s := _stats(r)) is not None}

    @property
    def num_queued(self) -> int:
        """Requests this caller holds that no replica has accepted yet."""
        return self.num_pending_requests


class LiveStats:
    """Polls the request routers of the tier handles into the observer."""

    def __init__(self, handles: dict, observer: Observer, period_s: float = 1.0,
                 stale_after_s: float = 10.0):
        self._handles = handles           # kind ("target" | "small") -> DeploymentHandle
        self.observer = observer
        self._period_s = period_s
        self._stale_after_s = stale_after_s
        self._task: asyncio.Task | None = None
        self._seeded: dict[str, EngineStats] = {}

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

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
                self._seeded[kind] = first["stats"]
                if not self.observer.replicas.get(kind):
                    self.observer.report("ready", first["stats"], kind)
                return
            except Exception as exc:
                logger.info("waiting for %s replicas (%s)", kind, exc)
                await asyncio.sleep(min(1.0 + attempt, 5.0))

    def poll(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for kind, handle in self._handles.items():
            router = _ROUTERS.get((handle.deployment_id.app_name, handle.deployment_id.name))
            if router is None:
                continue
            fresh = {rid: s for rid, s in router.replica_stats().items()
                     if s.time and now - s.time < self._stale_after_s}
            seeded = self._seeded.get(kind)
            if not fresh and seeded is not None and now - seeded.time < self._stale_after_s:
                fresh = {"ready": seeded}
            for rid, s in fresh.items():
                self.observer.report(rid, s, kind)
            self.observer.retain(kind, fresh)
            self.observer.queued(kind, router.num_queued)
