"""Discrete-event capacity simulator: replicas stepping continuous batches under a KV budget.

Owns the event loop, the replica model and one run's metrics. A replica admits requests FIFO
while their KV reservation (prompt + max_tokens, target KV and, in speculative mode, draft KV,
on every GPU) fits; it steps a continuous batch with chunked prefill; a step is up to k draft
rounds then one target verify, timed by a `StepCostModel`; each draft token at output position p
of a request is accepted iff that request's u_p < a (so every policy sees the same draws).
A replica estimates acceptance as the engine does (`engine/acceptance.py`) and reports
`EngineStats` as an engine does; routing goes through the live router's own path, those stats
into a `router.observer.Observer` and its `ClusterStats` into `router.policy.choose_tier`
(policy "auto"), or a fixed rule; k per step from `engine.cost_model.choose_k`. Knows nothing of
the CLI, plots, or the presets in scenarios.py beyond the dataclasses it is handed
(`build_replicas` turns a Deployment into replicas).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import random
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

from cluster.scenarios import AcceptanceMix, Deployment, RequestSpec, Workload, make_request
from engine.acceptance import (ENGINE_DECAY, ENGINE_PRIOR_TRIALS, SEQ_PRIOR_TRIALS,
                               AcceptanceEstimate, posterior)
from engine.config import EngineConfig
from engine.cost_model import CalibratedCost, StepCostModel, choose_k
from engine.hardware import GPUS, MODELS, GiB, RooflineStepCost
from engine.outputs import EngineStats
from router.observer import Observer, RequestOutcome
from router.policy import PolicyConfig, PolicyState, TierRequest, choose_tier

POLICIES = ("baseline", "speculative", "small", "auto")
PRIOR_ACCEPTANCE = EngineConfig.prior_acceptance  # what an engine assumes before it measures


@dataclass
class ReplicaConfig:
    cost: StepCostModel
    gpu_bytes: list[float]  # [num_gpus] device memory
    fixed_bytes: list[float]  # [num_gpus] weights + activation reserve
    target_kv: list[float]  # [num_gpus] bytes per token of target KV
    draft_kv: list[float]  # [num_gpus] bytes per token of draft KV (all 0: no draft)
    max_num_seqs: int = 256
    max_batched_tokens: int = 2048
    fixed_k: int = 0  # > 0: every speculative sequence drafts exactly this (the naive policy)
    engine_downgrade: bool = False  # free running sequences' draft KV when admission blocks


def build_replicas(dep: Deployment, placement: str, policy: str, fixed_k: int
                   ) -> tuple[ReplicaConfig, ReplicaConfig | None]:
    """The target replica (with its draft, if the policy can speculate) and the small replica."""
    gpu, target = GPUS[dep.gpu], MODELS[dep.target]
    draft = MODELS[dep.draft] if dep.draft and policy in ("speculative", "auto") else None
    tp, reserve = dep.tp, dep.activation_reserve_gib * GiB
    draft_tp = tp if placement == "sharded" else 1
    fixed = [target.weight_bytes() / tp + reserve] * tp
    tkv = [target.kv_bytes_per_token() / min(tp, target.num_kv_heads)] * tp
    dkv = [0.0] * tp
    for g in range(draft_tp if draft else 0):
        fixed[g] += draft.weight_bytes() / draft_tp
        dkv[g] = draft.kv_bytes_per_token() / min(draft_tp, draft.num_kv_heads)
    common = dict(max_num_seqs=dep.max_num_seqs, max_batched_tokens=dep.max_batched_tokens)
    tgt = ReplicaConfig(RooflineStepCost(gpu, target, draft, tp, draft_tp), [gpu.memory_bytes] * tp,
                        fixed, tkv, dkv, fixed_k=fixed_k if policy == "speculative" else 0,
                        engine_downgrade=policy == "auto", **common)
    if not dep.small:
        return tgt, None
    small, stp = MODELS[dep.small], dep.small_tp
    return tgt, ReplicaConfig(RooflineStepCost(gpu, small, None, stp), [gpu.memory_bytes] * stp,
                              [small.weight_bytes() / stp + reserve] * stp,
                              [small.kv_bytes_per_token() / min(stp, small.num_kv_heads)] * stp,
                              [0.0] * stp, **common)


@dataclass(eq=False)
class Seq:
    """A request in a replica: its mode, progress and acceptance estimate."""

    spec: RequestSpec
    arrival_s: float
    speculative: bool = False
    k_cap: int = 0
    prefill_left: int = 0
    emitted: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # steps ending on a rejection: accepted + rejected draft tokens were tried
    lag: int = 0  # emitted tokens the draft has not yet read (steps run with k = 0)
    admit_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    tier: str = ""
    reason: str = ""
    measured: bool = False
    _us: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prefill_left = self.spec.prompt_tokens
        self._rng = random.Random(self.spec.seed)

    def u(self, pos: int) -> float:  # the acceptance draw at output position pos
        while len(self._us) <= pos:
            self._us.append(self._rng.random())
        return self._us[pos]

    def estimate(self, replica_a: float) -> float:
        """The engine's estimate of this sequence's a: its counts behind the replica's a."""
        return posterior(self.accepted, self.accepted + self.rejected, replica_a, SEQ_PRIOR_TRIALS)

    @property
    def context(self) -> int:
        return self.spec.prompt_tokens - self.prefill_left + self.emitted


class Replica:
    """One replica's KV budget, queue and running batch; plans and applies steps."""

    def __init__(self, cfg: ReplicaConfig):
        self.cfg = cfg
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.used = [0.0] * len(cfg.gpu_bytes)  # [num_gpus] KV bytes reserved
        self.peak_bytes = max(cfg.fixed_bytes)
        self.busy = False
        self.blocked = 0  # requests the last admission pass could not admit
        self._k_cache: dict = {}
        self.acceptance = AcceptanceEstimate(PRIOR_ACCEPTANCE, ENGINE_PRIOR_TRIALS, ENGINE_DECAY)
        self.drafted = self.accepted = 0  # draft tokens since start (the dashboard's rate)

    def _need(self, seq: Seq, speculative: bool) -> list[float]:
        """[num_gpus] bytes reserved for seq: KV for prompt + max_tokens (draft KV if speculative)."""
        tokens = seq.spec.prompt_tokens + seq.spec.max_tokens
        c = self.cfg
        return [tokens * (t + (d if speculative else 0.0)) for t, d in zip(c.target_kv, c.draft_kv)]

    def fits(self, seq: Seq, speculative: bool, empty: bool = False) -> bool:
        c = self.cfg
        return all(f + (0.0 if empty else u) + n <= m for f, u, n, m in
                   zip(c.fixed_bytes, self.used, self._need(seq, speculative), c.gpu_bytes))

    def _charge(self, seq: Seq, sign: float, speculative: bool) -> None:
        self.used = [u + sign * n for u, n in zip(self.used, self._need(seq, speculative))]
        self.peak_bytes = max(self.peak_bytes, max(f + u for f, u in zip(self.cfg.fixed_bytes, self.used)))

    def _downgrade(self, seq: Seq) -> None:
        self._charge(seq, -1.0, True)
        self._charge(seq, +1.0, False)
        seq.speculative, seq.k_cap = False, 0

    def admit(self, now: float, timeout_s: float) -> list[Seq]:
        """Admit FIFO while the head fits; return requests refused for waiting too long."""
        refused = [s for s in self.waiting if now - s.arrival_s > timeout_s]
        if refused:
            self.waiting = deque(s for s in self.waiting if now - s.arrival_s <= timeout_s)
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if self.cfg.engine_downgrade and seq.speculative and not self.fits(seq, True):
                seq.speculative, seq.k_cap, seq.tier = False, 0, "baseline"  # no new speculation
                for victim in reversed(self.running):  # then free draft KV, newest first
                    if self.fits(seq, False):
                        break
                    if victim.speculative:
                        self._downgrade(victim)
            if not self.fits(seq, seq.speculative):
                break
            self.waiting.popleft()
            self._charge(seq, +1.0, seq.speculative)
            seq.admit_s = now
            self.running.append(seq)
        self.blocked = len(self.waiting)
        return refused

    def plan_step(self) -> tuple[float, list[tuple[Seq, int]], list[tuple[Seq, int]]] | None:
        """(seconds, [(decode seq, k)], [(prefill seq, chunk tokens)]) of the next step."""
        decode = [s for s in self.running if s.prefill_left == 0]
        budget = self.cfg.max_batched_tokens - len(decode)
        chunks = []
        for s in self.running:
            if s.prefill_left and budget > 0:
                chunks.append((s, min(s.prefill_left, budget)))
                budget -= chunks[-1][1]
        if not decode and not chunks:
            return None
        ctx = sum(s.context for s in self.running)
        extra = sum(c for _, c in chunks)
        ks = self._choose_ks(decode, ctx, extra)
        cost = self.cfg.cost
        seconds = cost.target_s(len(decode) + len(chunks), len(decode) + sum(ks) + extra, ctx)
        draft_prefill = sum(c for s, c in chunks if s.speculative)
        n_prefill = sum(1 for s, _ in chunks if s.speculative)
        catch_up = sum(s.lag for s, k in zip(decode, ks) if k)
        for j in range(1, max(max(ks, default=0), 1 if draft_prefill else 0) + 1):
            n_j = sum(1 for k in ks if k >= j)
            first = j == 1
            tokens = n_j + (draft_prefill + catch_up if first else 0)
            seqs = n_j + (n_prefill if first else 0)
            seconds += cost.draft_s(seqs, tokens, ctx * seqs // max(len(self.running), 1))
        return seconds, list(zip(decode, ks)), chunks

    def _choose_ks(self, decode: list[Seq], ctx: int, extra: int) -> list[int]:
        caps = [min(s.k_cap, s.spec.max_tokens - s.emitted - 1) if s.speculative else 0 for s in decode]
        if not any(caps):
            return [0] * len(decode)
        if self.cfg.fixed_k:
            return [min(c, self.cfg.fixed_k) for c in caps]
        a = self.acceptance.value
        accs = [round(s.estimate(a), 2) for s in decode]  # estimates to a 0.01 grid (cache key)
        ctx_b, extra_b = ctx // 8192 * 8192 + 4096, extra // 256 * 256
        key = (frozenset(Counter(zip(accs, caps)).items()), ctx_b, extra_b)
        by_group = self._k_cache.get(key)
        if by_group is None:
            by_group = dict(zip(zip(accs, caps), choose_k(accs, caps, self.cfg.cost, ctx_b, extra_b)))
            self._k_cache[key] = by_group
        return [by_group[g] for g in zip(accs, caps)]

    def apply_step(self, now: float, decode: list[tuple[Seq, int]], chunks: list[tuple[Seq, int]]
                   ) -> tuple[list[Seq], int]:
        """Emit the step's tokens at `now`; return the finished sequences and tokens emitted."""
        emitted = 0
        for s, k in decode:
            acc = 0
            while acc < k and s.u(s.emitted + acc) < s.spec.acceptance:
                acc += 1
            n = min(acc + 1, s.spec.output_tokens - s.emitted)
            s.emitted += n
            emitted += n
            s.drafted += k
            s.accepted += acc
            s.rejected += acc < k
            if k:
                self.acceptance.observe(acc, acc + (acc < k))
                self.drafted, self.accepted = self.drafted + k, self.accepted + acc
            s.lag = 0 if k else s.lag + (1 if s.speculative else 0)
        for s, c in chunks:
            s.prefill_left -= c
            if not s.prefill_left:
                s.emitted, s.first_token_s = 1, now
                emitted += 1
        finished = [s for s in self.running if s.emitted >= s.spec.output_tokens]
        for s in finished:
            s.finish_s = now
            self._charge(s, -1.0, s.speculative)
        if finished:
            self.running = [s for s in self.running if s.finish_s is None]
        return finished, emitted

    def engine_stats(self, now: float, max_context: int) -> EngineStats:
        """What this replica's engine would report (`record_routing_stats`), on its tightest GPU
        (the one with the fewest tokens of speculative KV left)."""
        c = self.cfg
        g = min(range(len(self.used)), key=lambda i: (c.gpu_bytes[i] - c.fixed_bytes[i] - self.used[i])
                / (c.target_kv[i] + c.draft_kv[i]))
        draft_used = sum(c.draft_kv[g] * (s.spec.prompt_tokens + s.spec.max_tokens)
                         for s in self.running if s.speculative)
        a = self.acceptance.value
        return EngineStats(
            num_running=len(self.running), num_waiting=min(self.blocked, len(self.waiting)),
            num_speculative=sum(1 for s in self.running if s.speculative),
            kv_budget_bytes=int(c.gpu_bytes[g] - c.fixed_bytes[g]),
            kv_used_target_bytes=int(self.used[g] - draft_used), kv_used_draft_bytes=int(draft_used),
            target_kv_bytes_per_token=c.target_kv[g], draft_kv_bytes_per_token=c.draft_kv[g],
            context_tokens=sum(s.context for s in self.running), max_model_len=max_context,
            cost=CalibratedCost(c.cost), acceptance_rate=self.accepted / self.drafted if self.drafted else None,
            token_acceptance=a if self.drafted else None,
            speculating_acceptance=tuple(s.estimate(a) for s in self.running if s.speculative),
            time=now)


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
