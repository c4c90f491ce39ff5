"""The target tier replica: one tensor-parallel group running the engine with its draft.

Serves both target tiers (speculative and baseline are per-request modes of the same engine
and batch; there is no second copy of the target). The replica process is rank 0: it starts
ranks 1..N-1 (`deployments/tp_group.py`), watches them, and builds the engine with the draft
in process. Deployment options (placement group, backpressure) are set in `deployments/app.py`.
"""

from __future__ import annotations

from ray import serve

from deployments.engine_server import ENGINE_CLASS, EngineServer
from deployments.tp_group import TP_WORKER_CLASS, TPGroup
from router.config import TierModelConfig


class TargetServer(EngineServer):
    kind = "target"

    def __init__(self, tier: TierModelConfig, engine_class: str = ENGINE_CLASS,
                 stats_period_s: float = 1.0, tp_worker_class: str = TP_WORKER_CLASS):
        from engine.tp_worker import rank_options

        config = tier.engine_config()
        # Ranks 1..N-1 start in bundles 1..N-1 and wait in the rendezvous; `peers()` joins this
        # process as rank 0. The engine then hands every rank its pool layout (tokens per block,
        # which the draft's KV shape sets, and block count), so block ids mean the same slots.
        self.tp_group = TPGroup.start(
            tier.tp_size, worker_kwargs=rank_options(config),
            num_cpus=tier.num_cpus_per_rank, num_gpus=tier.num_gpus_per_rank,
            worker_path=tp_worker_class)
        super().__init__(tier, engine_class, stats_period_s,
                         peers=self.tp_group.peers(config.device))
        self.tp_group.wait_ready()
        self.tp_group.watch(engine_alive=lambda: self.engine_alive)

    async def check_health(self) -> None:
        if self.tp_group.failed:
            raise RuntimeError(self.tp_group.failed)
        await super().check_health()

    async def tp_rank_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 (tests kill one to check the group is rebuilt)."""
        import ray

        return ray.get([a.pid.remote() for a in self.tp_group.actors])


TargetDeployment = serve.deployment(TargetServer, name="TargetServer")
