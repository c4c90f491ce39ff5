"""The simulator's replica: a KV budget over its GPUs, a FIFO queue and a continuous batch.

A replica admits requests FIFO while their KV reservation (prompt + max_tokens, target KV and,
in speculative mode, draft KV, on every GPU) fits; it steps a continuous batch with chunked
prefill; a step is up to k draft rounds then one target verify, timed by a `StepCostModel`, with
k per step from `engine.cost_model.choose_k`; each draft token at output position p of a request
is accepted iff that request's u_p < a (so every policy sees the same draws). It estimates
acceptance as the engine does (`engine/acceptance.py`) and reports `EngineStats` as an engine
does (`Replica.engine_stats`). `build_replicas` turns a scenario's Deployment into replicas.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field

from cluster.sim.scenarios import Deployment, RequestSpec
from engine.acceptance import (ENGINE_DECAY, ENGINE_PRIOR_TRIALS, SEQ_PRIOR_TRIALS,
                               AcceptanceEstimate, posterior)
from engine.config import EngineConfig
from engine.cost_model import CalibratedCost, StepCostModel, choose_k
from engine.hardware import GPUS, MODELS, GiB, RooflineStepCost
from engine.outputs import EngineStats

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
