"""One tensor-parallel group per target replica: ranks 1..N-1 as Ray actors, and their watch.

The Serve replica owns a placement group of N bundles (STRICT_PACK, so all ranks share a node
and talk over loopback or NVLink). The replica process is rank 0 and sits in bundle 0; this
module starts ranks 1..N-1 as `RankActor`s in bundles 1..N-1 and watches them. When a rank
dies the replica exits at once (`os._exit`): Serve sees a dead replica immediately, whereas a
failing `check_health` needs three misses (about 15 s); the ranks are the replica's children,
so they die with it, and Serve builds a new group.

Owns: placement, the rendezvous address, liveness. Does not own the sharding or the collectives
(`engine/tp_worker.py`, `TPWorker`), nor how the engine drives the ranks: `TPGroup.peers()` is the
hook the engine receives (`AsyncEngine(config, peers=TPGroup.peers())`). With tp_size = 1 nothing is started.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from typing import Any, Callable

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from models.rendezvous import free_port

logger = logging.getLogger(__name__)

TP_WORKER_CLASS = "engine.tp_worker:TPWorker"   # Ray-free: TPWorker(rank, world, init_method, ...)
TP_JOIN = "engine.tp_worker:init_tp"            # rank 0 joins: init_tp(0, world, init_method, device)


def import_object(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@ray.remote(max_restarts=0, max_task_retries=0)
class RankActor:
    """Hosts one `TPWorker` (rank >= 1) and runs its methods on request."""

    def __init__(self, worker_path: str, rank: int, world_size: int, init_method: str,
                 worker_kwargs: dict):
        self.rank = rank
        # Blocks in the process-group rendezvous until rank 0 joins, then loads its shard.
        self.worker = import_object(worker_path)(rank=rank, world=world_size,
                                                 init_method=init_method, **worker_kwargs)

    def ping(self) -> int:
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    def call(self, method: str, *args, **kwargs) -> Any:
        try:
            return getattr(self.worker, method)(*args, **kwargs)
        except Exception:
            if getattr(self.worker, "failed", None):    # a forward failed: the group is
                threading.Timer(0.2, _exit_now, ("rank failed",)).start()   # broken; leave
            raise                                       # (after the error reaches rank 0)


class RayPeers:
    """Ranks 1..N-1 as the engine sees them (`engine.model_runner.Peers`).

    `launch(...)` starts the same forward on every other rank (`TPWorker.run`), `wait()`
    collects them under a timeout (a timeout raises; the watch then takes the replica down).
    `all_reduce` is rank 0's collective over the group (gloo here, NCCL on GPUs).
    """

    def __init__(self, actors: list, init_method: str, device: str, timeout_s: float,
                 join_path: str = TP_JOIN):
        self.actors = actors
        self.init_method = init_method
        self.timeout_s = timeout_s
        self.world_size = len(actors) + 1
        # Rank 0 joins the group (the other ranks wait for it in their constructors).
        self.all_reduce = import_object(join_path)(0, self.world_size, init_method, device)
        self._refs: list = []

    def configure_pool(self, tokens_per_block: int, num_blocks: int, dtype: str,
                       graphs: tuple[str, int] | None = None) -> None:
        """Every rank takes rank 0's pool layout (tokens per block, block count, dtype) and its
        target's CUDA graphs (`TPWorker.configure_pool`)."""
        ray.get([a.call.remote("configure_pool", tokens_per_block, num_blocks, dtype, graphs)
                 for a in self.actors], timeout=self.timeout_s)

    def launch(self, message: tuple) -> None:
        """Start the forward `message` (`engine.model_runner.run_message`) on every rank."""
        self._refs = [a.call.remote("run", *message) for a in self.actors]

    def share(self, input_ids) -> None:
        """The forward's token ids, on rank 0's device, to every rank (after `launch`)."""
        from engine.tp_worker import share_ids

        share_ids(input_ids)

    def wait(self) -> None:
        refs, self._refs = self._refs, []
        ray.get(refs, timeout=self.timeout_s)

    def abort(self) -> None:
        """Break rank 0's side of the group (ranks blocked in a collective fail at once)."""
        from engine.tp_worker import leave_group

        leave_group()

    def inject_fault(self, count: int = 1, after: int = 0) -> None:
        """TEST ONLY: arm rank 1's mid-forward fault (engine/tp_worker.py, `TPWorker`)."""
        ray.get(self.actors[0].call.remote("inject_fault", count, after), timeout=self.timeout_s)


class TPGroup:
    """Ranks 1..N-1 of this replica's tensor-parallel group (none when tp_size = 1)."""

    def __init__(self, tp_size: int, actors: list, init_method: str | None, timeout_s: float):
        self.tp_size = tp_size
        self.actors = actors
        self.init_method = init_method
        self.timeout_s = timeout_s
        self.failed: str | None = None
        self._stop = threading.Event()

    @classmethod
    def start(cls, tp_size: int, worker_kwargs: dict, num_cpus: float = 1.0, num_gpus: float = 0.0,
              timeout_s: float = 60.0, worker_path: str = TP_WORKER_CLASS) -> "TPGroup":
        """Start ranks 1..N-1 in bundles 1..N-1 of the replica's placement group.

        They block in the process-group rendezvous until rank 0 (the engine, in this process)
        joins at `init_method`; the caller then builds the engine with `peers()`.
        """
        if tp_size == 1:
            return cls(1, [], None, timeout_s)
        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise RuntimeError(f"tp_size={tp_size} needs the replica to own a placement group of "
                               f"{tp_size} bundles (placement_group_bundles)")
        host = ray.util.get_node_ip_address()
        init_method = f"tcp://{host}:{free_port(host)}"
        actors = []
        for rank in range(1, tp_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=rank,
                placement_group_capture_child_tasks=False)
            actors.append(RankActor.options(num_cpus=num_cpus, num_gpus=num_gpus,
                                            scheduling_strategy=strategy).remote(
                worker_path, rank, tp_size, init_method, worker_kwargs))
        logger.info("started TP ranks 1..%d at %s", tp_size - 1, init_method)
        return cls(tp_size, actors, init_method, timeout_s)

    def peers(self, device: str = "cpu", join_path: str = TP_JOIN) -> RayPeers | None:
        """HOOK for the engine: `AsyncEngine(config, peers=...)` (None when tp_size = 1).

        Joins this process to the group as rank 0 (the ranks wait for it in the rendezvous).
        """
        if not self.actors:
            return None
        return RayPeers(self.actors, self.init_method, device, self.timeout_s, join_path)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        if not self.actors:      # (ray.get of nothing would start a Ray instance)
            return
        ray.get([a.ping.remote() for a in self.actors], timeout=timeout_s or self.timeout_s)

    def check(self, timeout_s: float = 5.0) -> None:
        """Raise if a rank is dead or does not answer within `timeout_s`."""
        if self.failed:
            raise RuntimeError(self.failed)
        if not self.actors:
            return
        refs = [a.ping.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            raise RuntimeError(f"a TP rank did not answer a ping within {timeout_s}s")
        ray.get(ready)       # raises RayActorError for a dead rank

    def watch(self, period_s: float = 1.0, on_failure: Callable[[str], None] | None = None,
              engine_alive: Callable[[], bool] | None = None) -> None:
        """Ping the ranks from a daemon thread; on the first failure (a rank lost, or the engine
        stopped, as it does when a forward failed on some rank) call `on_failure` (default:
        exit this process, so Serve replaces the whole group). A stopped engine is given one
        period first, for its streams' errors to reach their callers."""
        if not self.actors:
            return
        on_failure = on_failure or _exit_now

        def loop():
            while not self._stop.wait(period_s):
                try:
                    if engine_alive is not None and not engine_alive():
                        self._stop.wait(period_s)
                        raise RuntimeError("the engine stopped (a forward failed on a rank)")
                    self.check(timeout_s=max(5.0, period_s))
                except Exception as exc:   # RayActorError, GetTimeoutError, ...
                    self.failed = f"TP group lost: {exc}"
                    self._stop.wait(min(1.0, period_s))   # errors in flight reach callers
                    logger.error("%s; leaving so Serve rebuilds the group", self.failed)
                    on_failure(self.failed)
                    return

        threading.Thread(target=loop, name="tp-watch", daemon=True).start()

    def shutdown(self) -> None:
        self._stop.set()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


def _exit_now(reason: str) -> None:
    logging.shutdown()
    time.sleep(0.1)
    os._exit(1)
