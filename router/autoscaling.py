"""Autoscaling a tier on what its replicas report: a Serve custom autoscaling policy.

`decide(current, loads, rule, state, now) -> Decision` is a pure function of the replicas'
reports (each replica's queued plus running sequences, KV use and p95 time to first token over
the look-back window, `ReplicaLoad`), the tier's `Autoscaling` rule, the state carried from the
last call (`ScaleState`: since when a condition has held) and the time. No clock, I/O, torch or
Ray: `TierAutoscaler` is the thin adapter Serve's controller calls with its
`AutoscalingContext`, and it keeps `ScaleState` in Serve's `policy_state`.

Rules, first match wins (`per replica` = summed over the replicas, divided by `current`):
  current 0 and requests waiting at a handle   -> 1            cold_start  (at once)
  replicas still starting (Serve's target above current) -> the target   starting
  no replica has reported yet                  -> current      no_stats
  p95 TTFT of a replica > ttft_p95_s           -> current + 1  ttft_over_target  } after the
  queued + running per replica > target_sequences                                } condition
                           -> ceil(queued + running / target_sequences)          } held for
                                                               queue_over_target } upscale_delay_s
  KV use of a replica > kv_ceiling             -> current + 1  kv_full           }
  queued + running would fit current - 1 replicas at `downscale_share` of target_sequences,
    no TTFT or KV over its bound, held downscale_delay_s -> current - 1           stable_low
  otherwise                                    -> current      hold
The answer is clamped to [min_replicas, max_replicas]. A condition that stops holding resets its
clock: scale-up waits out a burst shorter than upscale_delay_s, scale-down waits for a stable
period. Serve then starts or stops replicas; a replica chosen for removal finishes its streams
first (`graceful_shutdown_timeout_s`). Why these signals and not Serve's default (ongoing
requests per replica): docs/decisions/0032-autoscaling.md.

This module is shipped to Serve's controller by value (cloudpickle): it imports only the
standard library and pydantic, which Serve itself needs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger("ray.serve")

METRICS = ("sequences", "kv_used", "ttft_p95_s")   # what a replica reports (record_autoscaling_stats)


class Autoscaling(BaseModel):
    """A tier's `autoscaling:` section."""
    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0, description="0: the tier may scale to zero when idle")
    max_replicas: int = Field(2, ge=1)
    initial_replicas: int | None = Field(None, ge=0, description="None: min_replicas (at least 1)")
    target_sequences: float = Field(8.0, gt=0, description="queued + running sequences per "
                                    "replica to aim for")
    ttft_p95_s: float | None = Field(None, gt=0, description="scale up when a replica's p95 "
                                     "time to first token exceeds this (None: not a signal)")
    kv_ceiling: float = Field(0.90, gt=0, le=1, description="KV use a replica may reach")
    downscale_share: float = Field(0.5, gt=0, le=1, description="scale down when the load fits "
                                   "one replica fewer at this share of target_sequences")
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(120.0, ge=0, description="the stable period")
    look_back_s: float = Field(20.0, gt=0, description="replicas' reports averaged over this "
                               "(more than Serve's 10 s metrics interval)")
    graceful_shutdown_s: float = Field(120.0, ge=0, description="a removed replica's time to "
                                       "finish its streams")

    @model_validator(mode="after")
    def _bounds(self) -> "Autoscaling":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below min_replicas "
                             f"({self.min_replicas})")
        if self.initial_replicas is not None and not (
                self.min_replicas <= self.initial_replicas <= self.max_replicas):
            raise ValueError("initial_replicas must lie in [min_replicas, max_replicas]")
        return self


@dataclass(frozen=True)
class ReplicaLoad:
    sequences: float              # queued + running sequences
    kv_used: float                # share of the KV budget held
    ttft_p95_s: float | None      # None: no first token in the window


@dataclass(frozen=True)
class ScaleState:
    up_since: float | None = None     # since when an upscale condition has held
    down_since: float | None = None   # since when the downscale condition has held


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    state: ScaleState


def decide(current: int, loads: list[ReplicaLoad], rule: Autoscaling, state: ScaleState,
           now: float, waiting_at_handles: float = 0.0, target: int | None = None) -> Decision:
    """The tier's replica count by the rules in this module's docstring: `current` replicas
    run and report `loads`; `target` (None: current) is the count Serve is moving to."""
    def clamp(n: int) -> int:
        return max(rule.min_replicas, min(rule.max_replicas, n))

    target = current if target is None else target
    if current == 0 and target == 0:
        if waiting_at_handles > 0:
            return Decision(clamp(1), "cold_start", ScaleState())
        return Decision(clamp(0), "hold", ScaleState())
    if target > current:       # replicas starting: what they will take is not yet measured
        return Decision(clamp(target), "starting", ScaleState())
    if not loads:
        return Decision(clamp(current), "no_stats", state)
    total = sum(r.sequences for r in loads) + waiting_at_handles
    slow = rule.ttft_p95_s is not None and any(
        r.ttft_p95_s is not None and r.ttft_p95_s > rule.ttft_p95_s for r in loads)
    full = any(r.kv_used > rule.kv_ceiling for r in loads)
    queue = total / current > rule.target_sequences
    if slow or queue or full:
        since = state.up_since if state.up_since is not None else now
        reason = "ttft_over_target" if slow else "queue_over_target" if queue else "kv_full"
        if now - since < rule.upscale_delay_s:
            return Decision(clamp(current), "hold", ScaleState(up_since=since))
        want = current + 1
        if queue:
            want = max(want, math.ceil(total / rule.target_sequences))
        return Decision(clamp(want), reason, ScaleState())
    low = current > 1 and total <= (current - 1) * rule.target_sequences * rule.downscale_share
    low = low or (current == 1 and rule.min_replicas == 0 and total == 0)
    if not low:
        return Decision(clamp(current), "hold", ScaleState())
    since = state.down_since if state.down_since is not None else now
    if now - since < rule.downscale_delay_s:
        return Decision(clamp(current), "hold", ScaleState(down_since=since))
    return Decision(clamp(current - 1), "stable_low", ScaleState())


class TierAutoscaler:
    """Serve's custom autoscaling policy for one tier (`AutoscalingPolicy(policy_function=
    "router.autoscaling:TierAutoscaler", policy_kwargs=<the tier's Autoscaling>)`): Serve
    builds it once and calls it with its `AutoscalingContext` on every control-loop tick."""

    def __init__(self, **rule):
        self.rule = Autoscaling(**rule)
        self._decisions = None      # the controller's counter of scaling decisions, once made

    def __call__(self, ctx) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics or {}
        replicas = set().union(*(metrics.get(m, {}) for m in METRICS)) if metrics else set()
        loads = []
        for rid in replicas:
            ttft = metrics.get("ttft_p95_s", {}).get(rid)
            loads.append(ReplicaLoad(metrics.get("sequences", {}).get(rid, 0.0),
                                     metrics.get("kv_used", {}).get(rid, 0.0),
                                     ttft if ttft and ttft > 0 else None))
        stored = ctx.policy_state or {}
        state = ScaleState(stored.get("up_since"), stored.get("down_since"))
        current = ctx.current_num_replicas
        queued = ctx.total_queued_requests or 0.0
        decision = decide(current, loads, self.rule, state, ctx.current_time, queued,
                          ctx.target_num_replicas)
        if decision.replicas != ctx.target_num_replicas:
            logger.info("autoscaling %s: %d -> %d replicas (%s)", ctx.deployment_name, current,
                        decision.replicas, decision.reason)
            self._count(ctx.deployment_name, decision.reason)
        return decision.replicas, {"up_since": decision.state.up_since,
                                   "down_since": decision.state.down_since,
                                   "reason": decision.reason}


    def _count(self, deployment: str, reason: str) -> None:
        """`specserve_scaling_decisions{deployment, reason}`: each change of the replica count
        this policy asks for (the Grafana dashboard's scaling panel)."""
        try:
            import ray

            if not ray.is_initialized():      # outside a Ray process (the unit tests)
                return
            if self._decisions is None:
                from ray.util import metrics

                self._decisions = metrics.Counter(
                    "specserve_scaling_decisions", tag_keys=("deployment", "reason"),
                    description="Replica-count changes the tier's autoscaling policy asked for.")
            self._decisions.inc(1, tags={"deployment": deployment, "reason": reason})
        except Exception:      # metrics must never stop the controller's autoscaling
            logger.exception("counting a scaling decision")


def serve_autoscaling_config(rule: Autoscaling) -> dict:
    """The deployment's `autoscaling_config` for Serve, with this module's policy."""
    from ray.serve.config import AutoscalingPolicy

    return {"min_replicas": rule.min_replicas, "max_replicas": rule.max_replicas,
            "initial_replicas": (rule.initial_replicas if rule.initial_replicas is not None
                                 else max(rule.min_replicas, 1)),
            "look_back_period_s": rule.look_back_s,
            # the rule's own delays hold: Serve's apply to its default policy only
            "upscale_delay_s": 0.0, "downscale_delay_s": 0.0,
            "policy": AutoscalingPolicy(policy_function="router.autoscaling:TierAutoscaler",
                                        policy_kwargs=rule.model_dump())}
