"""Discrete-event capacity simulator: the event loop over replicas, the routing, one run's metrics.

The replicas are `cluster/sim/replica.py`. Routing goes through the live router's own path:
each replica's `EngineStats` into a `router.observer.Observer`, its `ClusterStats` into
`router.policy.choose_tier` (policy "auto"), or a fixed rule (baseline, speculative, small).
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

POLICIES = ("baseline", "speculative", "small", "auto")


@dataclass
class RunResult:
    seqs: list[Seq]  # the measured requests, in arrival order
    window_s: float  # throughput window: first to last measured arrival
    window_tokens: int
    window_requests: int
    peak_memory_gib: float
    reasons: dict[str, int]

    def row(self) -> dict:
        done = [s for s in self.seqs if s.finish_s is not None]
        e2e = sorted(s.finish_s - s.arrival_s for s in done)
        tpot = sorted((s.finish_s - s.first_token_s) / (s.spec.output_tokens - 1)
                      for s in done if s.spec.output_tokens > 1)
        queue = sorted(s.admit_s - s.arrival_s for s in done)
        decode_s = sum(s.finish_s - s.first_token_s for s in done)
        return {
            "throughput_tok_s": self.window_tokens / self.window_s,
            "requests_s": self.window_requests / self.window_s,
            "p50_latency_s": _pct(e2e, 50), "p95_latency_s": _pct(e2e, 95),
            "p50_per_token_s": _pct(tpot, 50), "p95_per_token_s": _pct(tpot, 95),
            "decode_tok_s_per_seq": (sum(s.spec.output_tokens - 1 for s in done) / decode_s
                                     if decode_s else 0.0),
            "p50_queue_s": _pct(queue, 50), "p95_queue_s": _pct(queue, 95),
            "peak_memory_gib": self.peak_memory_gib,
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
             config: PolicyConfig = PolicyConfig()) -> RunResult:
    """One policy at one load: closed loop (load = users) or open loop (load = Poisson QPS).

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
    return _Run(target, small, policy, workload, mix, load, seed, max_context, config).result()


class _Run:
    """One simulation: the event heap, the routing, and what the live router would track."""

    def __init__(self, target, small, policy, workload, mix, load, seed, max_context, config):
        self.replicas = {"target": Replica(target), "small": Replica(small) if small else None}
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
        self.state = PolicyState()
        self.poisson = random.Random(f"{seed}:arrivals:{load}")
        if workload.closed_loop:
            for user in range(users):
                self.arrive_later(random.Random(f"{seed}:start:{user}").uniform(0.0, workload.start_spread_s),
                                  user, 0)
        else:
            self.arrive_later(self.poisson.expovariate(load), 0, 0)

    def arrive_later(self, at: float, user: int, index: int) -> None:
        spec = make_request(self.workload, self.mix, self.seed, user, index, self.max_context)
        heapq.heappush(self.events, (at + spec.think_s, next(self.order), "arrive", spec))

    def route(self, seq: Seq) -> Replica:
        if self.policy in ("baseline", "speculative"):
            seq.tier = seq.reason = self.policy
            seq.speculative, seq.k_cap = self.policy == "speculative", self.replicas["target"].cfg.fixed_k
            return self.replicas["target"]
        if self.policy == "small":
            seq.tier = seq.reason = "small"
            return self.replicas["small"]
        for kind, replica in self.replicas.items():
            if replica is not None:
                self.observer.report(kind, replica.engine_stats(seq.arrival_s, self.max_context), kind)
        req = TierRequest(self.workload.plan, "auto", self.workload.allow_downgrade, seq.spec.domain,
                          seq.spec.prompt_tokens, seq.spec.max_tokens)
        decision = choose_tier(req, self.observer.cluster_stats(), self.state, self.config)
        self.state = decision.state
        seq.tier, seq.reason, seq.k_cap = decision.tier, decision.reason, decision.k_max
        seq.speculative = decision.tier == "speculative"
        return self.replicas["small" if decision.tier == "small" and self.replicas["small"] else "target"]

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
                replica, (_, decode, chunks) = payload
                finished, tokens = replica.apply_step(now, decode, chunks)
                self.step_log.append((now, self.step_log[-1][1] + tokens))
                for seq in finished:
                    self.done(seq, now)
                self.kick(replica, now)
                continue
            seq = Seq(payload, now)
            seq.measured = self.warm <= self.arrivals < self.warm + self.measured
            self.arrivals += 1
            if not self.workload.closed_loop:
                self.arrive_later(now + self.poisson.expovariate(self.load), 0, self.arrivals)
            replica = self.route(seq)
            if seq.measured:
                self.seqs.append(seq)
                self.unfinished += 1
                self.reasons[seq.reason] += 1
            if not replica.fits(seq, seq.speculative, empty=True):
                self.done(seq, now)  # can never fit: refused
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
        peak = self.replicas["small" if self.policy == "small" else "target"].peak_bytes
        return RunResult(self.seqs, max(t1 - t0, 1e-9), tokens, completions, peak / GiB, dict(self.reasons))
