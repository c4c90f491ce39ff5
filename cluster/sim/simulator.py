"""Discrete-event capacity simulator: the event loop over replicas, the routing, one run's metrics.

The replicas are `cluster/sim/replica.py`. Routing goes through the live router's own path:
each replica's `EngineStats` into a `router.observer.Observer`, its `ClusterStats` into
`router.policy.choose_tier` (policy "auto"; "always-adaptive" is the same call with
`speculation: on`, as the API sends it), or a fixed rule (baseline, speculative at fixed k,
small over the small replicas, least loaded first). Arrivals: closed-loop users, or open loop
at a rate with Poisson (cv 1) or bursty (cv > 1, gamma) gaps.
Knows nothing of the CLI, plots, or the presets in scenarios.py beyond the dataclasses it is
handed.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
import statistics
from collections import Counter
from dataclasses import dataclass

from cluster.sim.replica import Replica, ReplicaConfig, Seq
from cluster.sim.scenarios import AcceptanceMix, Workload, make_request
from engine.hardware import GiB
from router.observer import Observer, RequestOutcome
from router.policy import PolicyConfig, PolicyState, TierRequest, choose_tier

POLICIES = ("baseline", "speculative", "always-adaptive", "small", "auto")


@dataclass
class RunResult:
    seqs: list[Seq]  # the measured requests, in arrival order
    window_s: float  # throughput window: first to last measured arrival
    window_tokens: int
    window_requests: int
    peak_memory_gib: float
    reasons: dict[str, int]
    gpus: int = 1  # GPUs the policy's replicas occupy
    gpu_hour_usd: float = 0.0
    slo_ttft_s: float = float("inf")
    slo_tpot_s: float = float("inf")
    preemptions: int = 0
    downgrades: int = 0
    calibrated_per_seq_s: float = 0.0  # what the serving engine learnt beyond its base model
    calibrated_spec_scale: float = 1.0  # ... and its draft's price over the base's
    path_s: float = 0.0  # Workload.path_s: in every latency and first token
    prefix_hit_rate: float | None = None  # prompt tokens found in the prefix cache (None: off)

    def row(self) -> dict:
        done = [s for s in self.seqs if s.finish_s is not None]
        path = self.path_s   # the requests reached the engine this long after they were sent
        e2e = sorted(s.finish_s - s.arrival_s + path for s in done)
        tpot_of = {id(s): (s.finish_s - s.first_token_s) / (s.spec.output_tokens - 1)
                   if s.spec.output_tokens > 1 else 0.0 for s in done}
        tpot = sorted(tpot_of[id(s)] for s in done if s.spec.output_tokens > 1)
        ttft = sorted(s.first_token_s - s.arrival_s + path for s in done)
        queue = sorted(s.admit_s - s.arrival_s for s in done)
        decode_s = sum(s.finish_s - s.first_token_s for s in done)
        met = [s for s in done if s.first_token_s - s.arrival_s + path <= self.slo_ttft_s
               and tpot_of[id(s)] <= self.slo_tpot_s]
        throughput = self.window_tokens / self.window_s
        usd_s = self.gpus * self.gpu_hour_usd / 3600.0
        return {
            "throughput_tok_s": throughput,
            "requests_s": self.window_requests / self.window_s,
            "p50_latency_s": _pct(e2e, 50), "p95_latency_s": _pct(e2e, 95),
            "p50_ttft_s": _pct(ttft, 50), "p95_ttft_s": _pct(ttft, 95),
            "p50_per_token_s": _pct(tpot, 50), "p95_per_token_s": _pct(tpot, 95),
            "slo_attainment": len(met) / len(self.seqs),  # refused requests count as misses
            "goodput_tok_s": throughput * sum(s.spec.output_tokens for s in met)
                             / max(sum(s.spec.output_tokens for s in self.seqs), 1),
            "usd_per_m_tokens": usd_s / throughput * 1e6 if throughput else float("inf"),
            "gpus": self.gpus, "preemptions": self.preemptions, "spec_downgrades": self.downgrades,
            "calibrated_per_seq_ms": self.calibrated_per_seq_s * 1e3,
            "calibrated_spec_scale": self.calibrated_spec_scale,
            "decode_tok_s_per_seq": (sum(s.spec.output_tokens - 1 for s in done) / decode_s
                                     if decode_s else 0.0),
            "p50_queue_s": _pct(queue, 50), "p95_queue_s": _pct(queue, 95),
            "peak_memory_gib": self.peak_memory_gib, "prefix_hit_rate": self.prefix_hit_rate,
            "refused": len(self.seqs) - len(done), "completed": len(done),
            "speculative_fraction": sum(1 for s in done if s.tier == "speculative") / max(len(done), 1),
            "acceptance_rate": sum(s.accepted for s in done) / max(sum(s.drafted for s in done), 1),
            "reasons": dict(sorted(self.reasons.items())),
        }


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def simulate(target: ReplicaConfig, small: ReplicaConfig | None, policy: str, workload: Workload,
             mix: AcceptanceMix, load: float, seed: int, max_context: int = 4096,
             config: PolicyConfig = PolicyConfig(), small_replicas: int = 1,
             gpu_hour_usd: float = 0.0) -> RunResult:
    """One policy at one load: closed loop (load = users) or open loop (load = QPS).

    Steady state: the first arrivals (closed loop: two per user) are not measured; the next
    `workload.requests` (at least eight per user) are; traffic goes on until every measured
    request has finished, so each runs under the full load. Throughput counts the tokens
    emitted between the first and the last measured arrival.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if policy == "small" and small is None:
        raise ValueError("policy 'small' needs a small replica")
    if load <= 0:
        raise ValueError(f"load must be positive, got {load}")
    run = _Run(target, small, policy, workload, mix, load, seed, max_context, config, small_replicas)
    result = run.result()
    serving = run.smalls if policy == "small" else [run.target]
    result.gpus = sum(r.cfg.gpus or len(r.cfg.gpu_bytes) for r in serving)
    result.gpu_hour_usd, result.slo_ttft_s, result.slo_tpot_s = (
        gpu_hour_usd, workload.slo_ttft_s, workload.slo_tpot_s)
    result.preemptions = sum(r.preemptions for r in serving)
    result.downgrades = sum(r.downgrades for r in serving)
    result.calibrated_per_seq_s = serving[0].belief.per_seq_s
    result.calibrated_spec_scale = serving[0].belief.spec_scale
    result.path_s = workload.path_s
    caches = [r.cache for r in serving if r.cache is not None]
    if caches and sum(c.queries for c in caches):
        result.prefix_hit_rate = sum(c.hits for c in caches) / sum(c.queries for c in caches)
    return result


class _Run:
    """One simulation: the event heap, the routing, and what the live router would track."""

    def __init__(self, target, small, policy, workload, mix, load, seed, max_context, config, small_replicas):
        self.target = Replica(target)
        self.smalls = [Replica(small) for _ in range(small_replicas)] if small else []
        self.policy, self.workload, self.mix, self.load = policy, workload, mix, load
        self.seed, self.max_context, self.config = seed, max_context, config
        users = int(load) if workload.closed_loop else 0
        self.measured = max(workload.requests, 8 * users)
        self.warm = 2 * users if workload.closed_loop else self.measured // 10
        self.events: list = []  # (time, order, kind, payload)
        self.order = itertools.count()
        self.arrivals, self.unfinished = 0, 0
        self.seqs: list[Seq] = []  # measured, in arrival order
        self.step_log: list[tuple[float, int]] = [(0.0, 0)]  # (time, cumulative tokens emitted)
        self.finish_log: list[float] = []
        self.reasons: Counter = Counter()
        # the router's view, through the live router's own observer
        self.observer = Observer(config.default_acceptance, ("target", "small") if small else ("target",))
        self.ids = {id(self.target): ("target", "target")}
        self.ids.update({id(r): ("small", f"small{i}") for i, r in enumerate(self.smalls)})
        self.state = PolicyState()
        self.poisson = random.Random(f"{seed}:arrivals:{load}")
        if workload.closed_loop:
            for user in range(users):
                self.arrive_later(random.Random(f"{seed}:start:{user}").uniform(0.0, workload.start_spread_s),
                                  user, 0)
        else:
            self.arrive_later(self.gap(), 0, 0)

    def gap(self) -> float:
        """Open loop: the time to the next arrival (mean 1 / load; cv 1: exponential)."""
        cv = self.workload.arrival_cv
        if cv == 1.0:
            return self.poisson.expovariate(self.load)
        shape = 1.0 / cv ** 2
        return self.poisson.gammavariate(shape, 1.0 / (shape * self.load))

    def arrive_later(self, at: float, user: int, index: int) -> None:
        """A request sent at `at` (after its think time) reaches the engine path_s later."""
        spec = make_request(self.workload, self.mix, self.seed, user, index, self.max_context)
        heapq.heappush(self.events, (at + spec.think_s + self.workload.path_s, next(self.order),
                                     "arrive", spec))

    def least_loaded_small(self) -> Replica:
        return min(self.smalls, key=lambda r: len(r.running) + len(r.waiting))

    def route(self, seq: Seq) -> Replica:
        if self.policy in ("baseline", "speculative"):
            seq.tier = seq.reason = self.policy
            seq.speculative, seq.k_cap = self.policy == "speculative", self.target.cfg.fixed_k
            return self.target
        if self.policy == "small":
            seq.tier = seq.reason = "small"
            return self.least_loaded_small()
        for replica in [self.target, *self.smalls]:
            kind, rid = self.ids[id(replica)]
            self.observer.report(rid, replica.engine_stats(seq.arrival_s, self.max_context), kind)
        speculation = "on" if self.policy == "always-adaptive" else "auto"
        req = TierRequest(self.workload.plan, speculation, self.workload.allow_downgrade, seq.spec.domain,
                          seq.spec.prompt_tokens, seq.spec.max_tokens)
        decision = choose_tier(req, self.observer.cluster_stats(), self.state, self.config)
        self.state = decision.state
        seq.tier, seq.reason, seq.k_cap = decision.tier, decision.reason, decision.k_max
        seq.speculative = decision.tier == "speculative"
        return self.least_loaded_small() if decision.tier == "small" and self.smalls else self.target

    def done(self, seq: Seq, now: float) -> None:
        """A request finished or was refused: record it, and its user sends the next one."""
        if seq.finish_s is not None:
            self.observer.finished(seq.tier, seq.spec.domain, RequestOutcome(
                seq.spec.prompt_tokens, seq.spec.output_tokens, seq.accepted, seq.accepted + seq.rejected))
        if seq.measured:
            self.unfinished -= 1
            if seq.finish_s is not None:
                self.finish_log.append(now)
        if self.workload.closed_loop:
            self.arrive_later(now, seq.spec.user, seq.spec.index + 1)

    def kick(self, replica: Replica, now: float) -> None:
        for seq in replica.admit(now, self.workload.queue_timeout_s):
            self.done(seq, now)
        plan = replica.plan_step()
        replica.busy = plan is not None
        if plan:
            heapq.heappush(self.events, (now + plan[0], next(self.order), "step", (replica, plan)))

    def result(self) -> RunResult:
        while self.events and (self.unfinished or len(self.seqs) < self.measured):
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "step":
                replica, (seconds, decode, chunks) = payload
                finished, tokens = replica.apply_step(now, seconds, decode, chunks)
                self.step_log.append((now, self.step_log[-1][1] + tokens))
                for seq in finished:
                    self.done(seq, now)
                self.kick(replica, now)
                continue
            seq = Seq(payload, now)
            seq.measured = self.warm <= self.arrivals < self.warm + self.measured
            self.arrivals += 1
            if not self.workload.closed_loop:
                self.arrive_later(now - self.workload.path_s + self.gap(), 0, self.arrivals)
            replica = self.route(seq)
            if seq.measured:
                self.seqs.append(seq)
                self.unfinished += 1
                self.reasons[seq.reason] += 1
            if replica.full() or not replica.fits(seq, seq.speculative, empty=True):
                self.done(seq, now)  # refused: the queue is full, or it can never fit
            else:
                replica.waiting.append(seq)
                if not replica.busy:
                    self.kick(replica, now)
        t0, t1 = self.seqs[0].arrival_s, self.seqs[-1].arrival_s
        times = [t for t, _ in self.step_log]
        tokens = (self.step_log[bisect.bisect_right(times, t1) - 1][1]
                  - self.step_log[bisect.bisect_right(times, t0) - 1][1])
        self.finish_log.sort()
        completions = bisect.bisect_right(self.finish_log, t1) - bisect.bisect_right(self.finish_log, t0)
        peak = max(r.peak_bytes for r in self.smalls) if self.policy == "small" else self.target.peak_bytes
        return RunResult(self.seqs, max(t1 - t0, 1e-9), tokens, completions, peak / GiB, dict(self.reasons))
