"""The one app builder: `build_app(AppConfig) -> Application`.

Wires the three deployments from one config: the target tier (a placement group of tp_size
bundles per replica, STRICT_PACK; the replica is rank 0), the small tier, and the ingress that
holds handles to both. Sets what Serve must know: bounded queues with 429 + Retry-After
(`max_queued_requests`, `BackpressureConfig`), the stats router and its period, the torch
thread count of every replica process. Used by `serve run deployments.app:build_app`, by a Serve
YAML (`import_path: deployments.app:build_app`, `args:` = the AppConfig fields) and by
`specserve up/deploy`.
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from deployments.alignment_loop import AlignmentLoopDeployment
from deployments.engine_server import ENGINE_CLASS
from deployments.small import SmallDeployment
from deployments.target import TargetDeployment
from deployments.tp_group import TP_WORKER_CLASS
from router.autoscaling import serve_autoscaling_config
from router.config import AppConfig, TierModelConfig
from router.ingress import IngressDeployment

STATS_ROUTER = "router.live_stats:StatsRequestRouter"


def _runtime_env(tier: TierModelConfig) -> dict:
    threads = str(tier.threads)
    return {"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
                         "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                         **_openmp_wait(tier)}}


def _openmp_wait(tier: TierModelConfig) -> dict[str, str]:
    """Replicas sharing a node's cores with each other and Ray sleep when idle (engine/__init__)."""
    from engine import BRIEF_SPIN_COUNT, SPIN_COUNT      # pure Python: imports no torch

    # Both variables, always: a replica inherits the raylet's environment, which may hold the
    # launcher's own choice, and libgomp lets an explicit GOMP_SPINCOUNT override the policy.
    if tier.openmp_wait == "spin":
        return {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": str(SPIN_COUNT)}
    if tier.openmp_wait == "brief":
        return {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": str(BRIEF_SPIN_COUNT)}
    return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}


def _tier_options(tier: TierModelConfig, cfg: AppConfig) -> dict:
    bundle = {"CPU": tier.num_cpus_per_rank, **tier.resources}
    if tier.num_gpus_per_rank:
        bundle["GPU"] = tier.num_gpus_per_rank
    options = dict(
        num_replicas=tier.num_replicas,
        max_ongoing_requests=tier.serve_max_ongoing,
        max_queued_requests=tier.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429,
                                               retry_after_s=cfg.limits.retry_after_s),
        request_router_config=RequestRouterConfig(
            request_router_class=STATS_ROUTER,
            request_routing_stats_period_s=cfg.stats.period_s,
            request_routing_stats_timeout_s=max(5.0, 5 * cfg.stats.period_s)),
        health_check_period_s=5.0, health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=(5.0 if tier.autoscaling is None
                                     else tier.autoscaling.graceful_shutdown_s),
        ray_actor_options={"num_cpus": tier.num_cpus_per_rank, "num_gpus": tier.num_gpus_per_rank,
                           "resources": dict(tier.resources), "runtime_env": _runtime_env(tier)})
    if tier.autoscaling is not None:      # Serve's autoscaler sets the count
        del options["num_replicas"]
        options["autoscaling_config"] = serve_autoscaling_config(tier.autoscaling)
    if tier.tp_size > 1:
        # One placement group per replica: bundle 0 holds the replica (rank 0), bundles
        # 1..N-1 the other ranks. STRICT_PACK keeps the group on one node.
        options["placement_group_bundles"] = [dict(bundle) for _ in range(tier.tp_size)]
        options["placement_group_strategy"] = "STRICT_PACK"
    return options


def build_app(args: AppConfig | dict, engine_class: str = ENGINE_CLASS,
              tp_worker_class: str = TP_WORKER_CLASS) -> Application:
    """The Serve application for one config (a dict is validated as an `AppConfig`)."""
    cfg = args if isinstance(args, AppConfig) else AppConfig.model_validate(args)
    period = cfg.stats.period_s
    target = TargetDeployment.options(**_tier_options(cfg.target, cfg)).bind(
        cfg.target, engine_class, period, tp_worker_class)
    small = None
    if cfg.small is not None:
        small = SmallDeployment.options(**_tier_options(cfg.small, cfg)).bind(
            cfg.small, engine_class, period)
    ingress = IngressDeployment.options(
        num_replicas=cfg.ingress_num_replicas,
        max_ongoing_requests=cfg.limits.max_ongoing_requests,
        max_queued_requests=cfg.limits.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429,
                                               retry_after_s=cfg.limits.retry_after_s),
        ray_actor_options={"num_cpus": cfg.ingress_num_cpus,
                           "runtime_env": {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}})
    loop = None
    if cfg.alignment.enabled:
        loop = AlignmentLoopDeployment.options(
            ray_actor_options={"num_cpus": cfg.alignment.num_cpus}).bind(cfg, cfg.name, target)
    return ingress.bind(cfg, target, small, loop)


__all__ = ["build_app", "serve"]
