"""The simulator's replica: paged KV over its GPUs, a FIFO queue and a continuous batch.

Memory is paged as the engine's scheduler pages it (`engine/scheduler.py`), by the same rules
(`engine/kv_rules.py`) applied to bytes on each GPU: a running sequence holds KV blocks for the
tokens it has computed plus what the next step writes (its chunk, or 1 + k); a request is
admitted when its prompt fits beside one growth block per running sequence, and a speculative
one as baseline when it would leave too little headroom; when a step's blocks do not fit,
speculating sequences drop to baseline first (draft KV freed) and then sequences are preempted
(all KV freed, prefilled again later with the tokens they had), in the engine's victim order.
A request whose prompt + max_tokens cannot fit the empty replica is refused, and so is one
that arrives while `max_waiting` requests wait (the engine's queue bound:
`LLMEngine.add_request` refuses with 429 beyond it).
A step is up to k draft rounds then one target verify. Two cost models: `ReplicaConfig.cost`
is the truth and times every step; the engine's belief (`believed`, default the truth) is a
`CalibratedCost` that picks k by the engine's own rule (`engine.k_rule.engine_choose_k`, with
the draft's catch-up priced as the engine prices it: a draft reads its prompt in the sequence's
first drafting step, and what it skipped in its next one), calibrates on each decode step as
`LLMEngine` does, and is what `engine_stats` reports to the router. Each draft token at output
position p of a request is accepted iff that request's u_p < a (every policy sees the same
draws). Acceptance is estimated as the engine does (`engine/acceptance.py`).
With prefix caching (`ReplicaConfig.prefix_caching`, the engine's default), prompts that share
a prefix (`RequestSpec.prefix`) reuse its KV by the engine's rules (`cluster/sim/prefix.py`).
`build_replicas` turns a scenario's Deployment into replica configs.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field

from cluster.sim.fitted import FITTED
from cluster.sim.prefix import PrefixCache
from cluster.sim.scenarios import Deployment, RequestSpec
from engine import kv_rules
from engine.acceptance import (ENGINE_DECAY, ENGINE_PRIOR_TRIALS, SEQ_PRIOR_TRIALS,
                               AcceptanceEstimate, posterior)
from engine.calibration import CATCH_UP_MAX, CalibratedCost
from engine.config import EngineConfig, default_prefill_align
from engine.hardware import GPUS, MODELS, GiB, RooflineStepCost
from engine.k_rule import DraftProbe, catch_up_prices, engine_choose_k
from engine.outputs import EngineStats
from engine.sampling_params import RequestOptions
from engine.step_cost import StepCostModel, step_parts

PRIOR_ACCEPTANCE = EngineConfig.prior_acceptance  # what an engine assumes before it measures
BLOCK_TOKENS = EngineConfig.block_size
DRAFTING = ("speculative", "always-adaptive", "auto")  # policies whose target replica has a draft


@dataclass
class ReplicaConfig:
    cost: StepCostModel  # the true step times
    gpu_bytes: list[float]  # [num_gpus] device memory
    fixed_bytes: list[float]  # [num_gpus] weights + activation reserve
    target_kv: list[float]  # [num_gpus] bytes per token of target KV
    draft_kv: list[float]  # [num_gpus] bytes per token of draft KV (all 0: no draft)
    max_num_seqs: int = 256
    max_batched_tokens: int = 2048
    fixed_k: int = 0  # > 0: every speculative sequence drafts exactly this (the naive policy)
    engine_downgrade: bool = False  # drop speculation before preempting, and admit as baseline
    #   when headroom is low (the engine's scheduler); False: the naive fixed-k engine
    believed: StepCostModel | None = None  # the engine's base cost model (None: the truth)
    gpus: int = 0  # GPUs this replica occupies (for cost per token; 0: len(gpu_bytes))
    max_waiting: int | None = None  # the engine's queue bound (None: unbounded)
    prefix_caching: bool = True  # reuse cached prompt prefixes (the engine's default)


def _cost(dep: Deployment, model: str, tp: int, draft_tp: int):
    """The true step times: fitted to published tables where we have them, else the roofline."""
    fitted = FITTED.get((dep.gpu, model, tp, draft_tp))
    if dep.step_times == "fitted" and fitted is not None:
        return fitted, fitted.mismatched(dep.cost_mismatch)
    if dep.step_times == "fitted":
        raise ValueError(f"no fitted step times for {model} tp {tp} draft_tp {draft_tp} on {dep.gpu}")
    gpu = GPUS[dep.gpu]
    draft = MODELS[dep.draft] if draft_tp else None
    return RooflineStepCost(gpu, MODELS[model], draft, tp, max(draft_tp, 1)), None


def build_replicas(dep: Deployment, placement: str, policy: str, fixed_k: int
                   ) -> tuple[ReplicaConfig, ReplicaConfig | None]:
    """The target replica (with its draft, if the policy can speculate) and one small replica
    (the scenario runs `dep.small_replicas` of them)."""
    gpu, target = GPUS[dep.gpu], MODELS[dep.target]
    draft = MODELS[dep.draft] if dep.draft and policy in DRAFTING else None
    tp, reserve = dep.tp, dep.activation_reserve_gib * GiB
    draft_tp = tp if placement == "sharded" else 1
    fixed = [target.weight_bytes() / tp + reserve] * tp
    tkv = [target.kv_bytes_per_token() / min(tp, target.num_kv_heads)] * tp
    dkv = [0.0] * tp
    for g in range(draft_tp if draft else 0):
        fixed[g] += draft.weight_bytes() / draft_tp
        dkv[g] = draft.kv_bytes_per_token() / min(draft_tp, draft.num_kv_heads)
    common = dict(max_num_seqs=dep.max_num_seqs, max_batched_tokens=dep.max_batched_tokens,
                  prefix_caching=dep.prefix_caching)
    true, believed = _cost(dep, dep.target, tp, draft_tp if draft else 0)
    naive = policy == "speculative" and fixed_k > 0
    tgt = ReplicaConfig(true, [gpu.memory_bytes] * tp, fixed, tkv, dkv,
                        fixed_k=fixed_k if naive else 0, engine_downgrade=not naive,
                        believed=believed, **common)
    if not dep.small:
        return tgt, None
    small, stp = MODELS[dep.small], dep.small_tp
    true, believed = _cost(dep, dep.small, stp, 0)
    return tgt, ReplicaConfig(true, [gpu.memory_bytes] * stp, [small.weight_bytes() / stp + reserve] * stp,
                              [small.kv_bytes_per_token() / min(stp, small.num_kv_heads)] * stp,
                              [0.0] * stp, engine_downgrade=True, believed=believed, **common)


def _blocks(tokens: int) -> int:
    """Tokens rounded up to whole KV blocks."""
    return kv_rules.blocks_needed(tokens, BLOCK_TOKENS) * BLOCK_TOKENS


@dataclass(eq=False)
class Seq:
    """A request in a replica: its mode, progress, KV held and acceptance estimate."""

    spec: RequestSpec
    arrival_s: float
    speculative: bool = False
    k_cap: int = 0
    prefill_left: int = 0  # tokens still to (re)compute before the next token
    computed: int = 0  # tokens whose target KV is written
    held: int = 0  # tokens of KV blocks held (target; and draft, if speculative)
    shared: int = 0  # of the target's, tokens held in prefix-cache entries (counted there)
    cache_keys: list = field(default_factory=list)  # the prefix-cache entries it holds
    emitted: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # steps ending on a rejection: accepted + rejected draft tokens were tried
    lag: int = 0  # tokens the draft has not yet read: the prompt (the engine's draft first reads
    #   it in the sequence's first drafting step), then tokens of steps run with k = 0
    preempted: int = 0
    admit_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    tier: str = ""
    reason: str = ""
    measured: bool = False
    priority: int = RequestOptions.priority  # the simulated requests all take its default
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
        return self.computed


class Replica:
    """One replica's paged KV, queue and running batch; plans and applies steps."""

    def __init__(self, cfg: ReplicaConfig):
        self.cfg = cfg
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.used = [0.0] * len(cfg.gpu_bytes)  # [num_gpus] KV bytes held
        self.peak_bytes = max(cfg.fixed_bytes)
        self.busy = False
        self.blocked = 0  # requests the last admission pass could not admit
        self.preemptions = self.downgrades = 0
        self._k_cache: dict = {}
        self.belief = CalibratedCost(cfg.believed or cfg.cost, draft_excess=True)   # the engine's
        self.split = (0.0, 0.0)   # the planned step's draft rounds and verify forward, seconds
        self.gap = 0.0            # ... and the engine loop's time before it
        self.probe = DraftProbe()    # the engine's: drafts now and then when no one has
        self.acceptance = AcceptanceEstimate(PRIOR_ACCEPTANCE, ENGINE_PRIOR_TRIALS, ENGINE_DECAY)
        self.drafted = self.accepted = 0  # draft tokens since start (the dashboard's rate)
        unit = kv_rules.prefix_unit(BLOCK_TOKENS, default_prefill_align(cfg.max_batched_tokens))
        self.cache = PrefixCache(BLOCK_TOKENS, unit) if cfg.prefix_caching else None

    # -- memory -------------------------------------------------------------------------------
    def _bytes(self, tokens: int, speculative: bool) -> list[float]:
        c = self.cfg
        return [tokens * (t + (d if speculative else 0.0)) for t, d in zip(c.target_kv, c.draft_kv)]

    def full(self) -> bool:
        """The engine's waiting queue is at its bound: an arrival is refused (429)."""
        return self.cfg.max_waiting is not None and len(self.waiting) >= self.cfg.max_waiting

    def fits(self, seq: Seq, speculative: bool, empty: bool = False) -> bool:
        """Whether prompt + max_tokens fits (on the empty replica: whether it ever can)."""
        c, need = self.cfg, self._bytes(_blocks(seq.spec.prompt_tokens + seq.spec.max_tokens), speculative)
        return all(f + (0.0 if empty else u) + n <= m
                   for f, u, n, m in zip(c.fixed_bytes, self.used, need, c.gpu_bytes))

    def _own(self, seq: Seq, tokens: int, speculative: bool) -> list[float]:
        """The bytes of seq's KV at `tokens` tokens that no prefix-cache entry counts."""
        c, own = self.cfg, max(tokens - seq.shared, 0)
        return [own * t + (tokens * d if speculative else 0.0) for t, d in zip(c.target_kv, c.draft_kv)]

    def _cached(self, tokens: int) -> list[float]:
        return [tokens * t for t in self.cfg.target_kv]

    def _hold(self, seq: Seq, tokens: int, speculative: bool) -> None:
        """seq now holds `tokens` of KV (draft KV too if speculative); at 0 it lets go of its
        prefix-cache entries, and a cache that no longer fits beside what is held shrinks."""
        old, new = self._own(seq, seq.held, seq.speculative), self._own(seq, tokens, speculative)
        self.used = [u - o + n for u, o, n in zip(self.used, old, new)]
        seq.held, seq.speculative = tokens, speculative
        if not tokens and seq.cache_keys:
            self.cache.release(seq.cache_keys)
            seq.cache_keys, seq.shared = [], 0
        c = self.cfg
        while self.cache is not None and any(
                f + u + b > m for f, u, b, m in zip(c.fixed_bytes, self.used,
                                                    self._cached(self.cache.tokens), c.gpu_bytes)):
            if not self.cache.evict():
                break
        held = self._cached(self.cache.held_tokens if self.cache else 0)
        self.peak_bytes = max(self.peak_bytes, max(f + u + h for f, u, h in zip(c.fixed_bytes, self.used, held)))

    def _free_bytes(self) -> list[float]:
        """Per GPU, what is neither held by a sequence nor by a cache entry a sequence holds
        (unheld entries are evicted when the memory is taken)."""
        c, held = self.cfg, self._cached(self.cache.held_tokens if self.cache else 0)
        return [m - f - u - h for m, f, u, h in zip(c.gpu_bytes, c.fixed_bytes, self.used, held)]

    def _downgrade(self, seq: Seq) -> None:
        self._hold(seq, seq.held, False)
        seq.k_cap, seq.lag = 0, 0
        self.downgrades += 1

    def _preempt(self, seq: Seq) -> None:
        self._hold(seq, 0, seq.speculative)
        self.running.remove(seq)
        seq.prefill_left, seq.computed, seq.lag = seq.spec.prompt_tokens + seq.emitted, 0, 0
        seq.preempted += 1
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def admit(self, now: float, timeout_s: float) -> list[Seq]:
        """Admit FIFO while the head's prompt fits; return requests refused for waiting too long
        (never admitted; preempted ones wait as long as it takes)."""
        refused = [s for s in self.waiting if s.admit_s is None and now - s.arrival_s > timeout_s]
        if refused:
            self.waiting = deque(s for s in self.waiting if s not in refused)
        budget = [m - f for m, f in zip(self.cfg.gpu_bytes, self.cfg.fixed_bytes)]
        growth = self._bytes(BLOCK_TOKENS, False)   # [num_gpus] one block of a running sequence
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            tokens = _blocks(seq.prefill_left + 1)
            # the cached prefix it may take, its entries, and tokens of them no one holds
            hit, keys, unheld = (self.cache.lookup(seq.spec.prefix, seq.spec.prompt_tokens)
                                 if self.cache else (0, [], 0))
            free = self._free_bytes()

            def need(speculative: bool) -> list[float]:   # its own KV and the entries it holds
                return [n - b + u for n, b, u in zip(self._bytes(tokens, speculative),
                                                    self._cached(hit), self._cached(unheld))]
            if seq.speculative and self.cfg.engine_downgrade and not all(
                    kv_rules.keeps_speculation(fr - n, b)
                    for fr, n, b in zip(free, need(True), budget)):
                seq.speculative, seq.k_cap, seq.tier = False, 0, "baseline"  # admitted as baseline
            if not all(kv_rules.fits_beside_growth(n, fr, len(self.running), g)
                       for n, fr, g in zip(need(seq.speculative), free, growth)):
                break
            self.waiting.popleft()
            if self.cache is not None:
                self.cache.hold(keys, seq.spec.prompt_tokens, hit)
                seq.cache_keys, seq.shared = keys, hit
                seq.computed, seq.prefill_left = hit, seq.prefill_left - hit
            self._hold(seq, tokens, seq.speculative)
            if seq.admit_s is None:
                seq.admit_s = now
            self.running.append(seq)
        self.blocked = len(self.waiting)
        return refused

    # -- steps --------------------------------------------------------------------------------
    def plan_step(self) -> tuple[float, list[tuple[Seq, int]], list[tuple[Seq, int]]] | None:
        """(true seconds, [(decode seq, k)], [(prefill seq, chunk tokens)]) of the next step,
        after making its KV fit (dropping speculation, then preempting: `kv_rules.next_victim`;
        the naive fixed-k engine only preempts)."""
        while True:
            decode, ks, chunks = self._plan()
            need = [(s, _blocks(s.computed + 1 + k)) for s, k in zip(decode, ks)]
            need += [(s, _blocks(s.computed + c)) for s, c in chunks]
            free = self._free_bytes()
            extra = [0.0] * len(free)
            for s, t in need:
                if t > s.held:
                    extra = [e + b for e, b in zip(extra, self._bytes(t - s.held, s.speculative))]
            if all(e <= fr for e, fr in zip(extra, free)):
                break
            victim, drops = kv_rules.next_victim(
                self.running, lambda s: s.priority, lambda s: s.arrival_s,
                lambda s: self.cfg.engine_downgrade and s.speculative)
            if drops:
                self._downgrade(victim)
            elif len(self.running) > 1:
                self._preempt(victim)
            else:   # alone: never short, as arrivals that cannot fit the empty replica are refused
                break
        for s, t in need:
            if t > s.held:
                self._hold(s, t, s.speculative)
        if not decode and not chunks:
            return None
        return self._seconds(decode, ks, chunks), list(zip(decode, ks)), chunks

    def _plan(self):
        decode = [s for s in self.running if s.prefill_left == 0]
        budget = self.cfg.max_batched_tokens - len(decode)
        chunks = []
        for s in self.running:
            if s.prefill_left and budget > 0:
                chunks.append((s, min(s.prefill_left, budget)))
                budget -= chunks[-1][1]
        ctx = sum(s.context for s in self.running)
        ks = self._choose_ks(decode, ctx, sum(c for _, c in chunks)) if decode else []
        return decode, ks, chunks

    def _seconds(self, decode, ks, chunks) -> float:
        """The step's true time; its draft rounds' and verify forward's parts, which the engine
        times apart for its calibration, are kept in `self.split`."""
        ctx = sum(s.context for s in self.running)
        extra = sum(c for _, c in chunks)
        cost = self.cfg.cost
        # A draft reads what it has not read (the prompt included) in its first round.
        first = sum(1 + s.lag for s, k in zip(decode, ks) if k)
        drafting, verify = step_parts(cost, list(ks) + [0] * len(chunks), len(decode) + len(chunks),
                                      len(decode) + sum(ks) + extra, first, ctx)
        self.split = (drafting, verify)
        # the engine loop's time before the step (its messages; the served engine's LoopTimes),
        # which it does not calibrate on
        self.gap = getattr(cost, "gap_s", lambda n: 0.0)(len(decode) + len(chunks))
        return verify + drafting + self.gap

    def _choose_ks(self, decode: list[Seq], ctx: int, extra: int) -> list[int]:
        caps = [min(s.k_cap, s.spec.max_tokens - s.emitted - 1) if s.speculative else 0 for s in decode]
        if not any(caps):
            return [0] * len(decode)
        if self.cfg.fixed_k:
            return [min(c, self.cfg.fixed_k) for c in caps]
        a = self.acceptance.value
        accs = [round(s.estimate(a), 2) for s in decode]  # estimates to a 0.01 grid (cache key)
        ctx_b, extra_b = ctx // 8192 * 8192 + 4096, extra // 256 * 256
        per_seq = round(self.belief.per_seq_s, 5)  # what the engine learnt, to a 10 us grid
        scale = round(self.belief.spec_scale, 2)  # ... and to a 1% grid
        belief = CalibratedCost(self.belief.base, per_seq, scale)
        # k by the engine's own rule (`engine_choose_k`: pure goodput, the latency guard being
        # the router's; MIN_GAIN; no split batches) with its catch-up price; the prices to two
        # significant digits (cache key).
        prices = catch_up_prices(belief, accs, [s.lag if c else 0 for s, c in zip(decode, caps)],
                                 [s.spec.max_tokens - s.emitted for s in decode], ctx_b)
        prices = [float(f"{p:.2g}") for p in prices] if prices else [0.0] * len(decode)
        groups = list(zip(accs, caps, prices))
        key = (frozenset(Counter(groups).items()), ctx_b, extra_b, per_seq, scale)
        by_group = self._k_cache.get(key)
        if by_group is None:
            by_group = dict(zip(groups, engine_choose_k(accs, caps, belief, ctx_b, extra_b,
                                                        prices if any(prices) else None)))
            self._k_cache[key] = by_group
        return self.probe([by_group[g] for g in groups], caps, [s.lag for s in decode])

    def apply_step(self, now: float, seconds: float, decode: list[tuple[Seq, int]],
                   chunks: list[tuple[Seq, int]]) -> tuple[list[Seq], int]:
        """Emit the step's tokens at `now` (the step took `seconds`); return the finished
        sequences and the tokens emitted."""
        # The engine calibrates its belief on decode steps, not those where a draft reads a prompt.
        reading = max((s.lag for s, k in decode if k), default=0)
        if decode and not chunks and reading <= CATCH_UP_MAX:
            drafting, verify = self.split
            self.belief.calibrate([k for _, k in decode], sum(s.context for s, _ in decode),
                                  seconds - self.gap,
                                  could_draft=any(s.speculative for s, _ in decode),
                                  draft_seconds=drafting, verify_seconds=verify)
        emitted = 0
        for s, k in decode:
            acc = 0
            while acc < k and s.u(s.emitted + acc) < s.spec.acceptance:
                acc += 1
            n = min(acc + 1, s.spec.output_tokens - s.emitted)
            s.emitted += n
            s.computed += n
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
            s.computed += c
            if not s.prefill_left:  # the prompt (or, after a preemption, everything) is in
                if self.cache is not None and s.spec.prefix:   # its full blocks are cached
                    moved, s.cache_keys = self.cache.insert(s.spec.prefix, s.spec.prompt_tokens,
                                                            s.cache_keys)
                    self.used = [u - b for u, b in zip(self.used, self._cached(moved))]
                    s.shared += moved
                s.lag = s.computed if s.speculative else 0   # the draft has read none of it
                s.emitted += 1
                emitted += 1
                if s.first_token_s is None:
                    s.first_token_s = now
        finished = [s for s in self.running if s.emitted >= s.spec.output_tokens]
        for s in finished:
            s.finish_s = now
            self._hold(s, 0, s.speculative)
        if finished:
            self.running = [s for s in self.running if s.finish_s is None]
        for s in self.running:  # rejected drafts' slots go back (engine/scheduler.py trim)
            if s.held > _blocks(s.computed + 1):
                self._hold(s, _blocks(s.computed + 1), s.speculative)
        return finished, emitted

    def engine_stats(self, now: float, max_context: int) -> EngineStats:
        """What this replica's engine would report (`record_routing_stats`), on its tightest GPU
        (the one with the fewest tokens of speculative KV left)."""
        c = self.cfg
        g = min(range(len(self.used)), key=lambda i: (c.gpu_bytes[i] - c.fixed_bytes[i] - self.used[i])
                / (c.target_kv[i] + c.draft_kv[i]))
        draft_used = sum(c.draft_kv[g] * s.held for s in self.running if s.speculative)
        a = self.acceptance.value
        return EngineStats(
            num_running=len(self.running), num_waiting=min(self.blocked, len(self.waiting)),
            num_speculative=sum(1 for s in self.running if s.speculative),
            kv_budget_bytes=int(c.gpu_bytes[g] - c.fixed_bytes[g]),
            kv_used_target_bytes=int(self.used[g] - draft_used
                                     + c.target_kv[g] * (self.cache.held_tokens if self.cache else 0)),
            kv_used_draft_bytes=int(draft_used),
            target_kv_bytes_per_token=c.target_kv[g], draft_kv_bytes_per_token=c.draft_kv[g],
            context_tokens=sum(s.context for s in self.running), max_model_len=max_context,
            cost=CalibratedCost(self.belief.base, self.belief.per_seq_s, self.belief.spec_scale),
            acceptance_rate=self.accepted / self.drafted if self.drafted else None,
            token_acceptance=a if self.drafted else None,
            speculating_acceptance=tuple(s.estimate(a) for s in self.running if s.speculative),
            prefix_cache_queries=self.cache.queries if self.cache else 0,
            prefix_cache_hits=self.cache.hits if self.cache else 0,
            time=now)
