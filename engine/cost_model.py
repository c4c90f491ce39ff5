"""Step-time cost model: what one target verify and one draft step cost, and the k that pays.

The one cost model the engine, the router policy and the capacity simulator share. Pure Python:
no torch, no Ray, no numpy, so `import engine.cost_model` is cheap everywhere.

Vocabulary (docs/architecture.md): a *step* is one target forward over a batch, preceded by up to k draft
rounds. A cost model answers two questions, both in seconds:
  target_s(num_seqs, num_tokens, context_tokens)  one target forward over num_seqs sequences
      carrying num_tokens query tokens in total and reading context_tokens KV tokens in total;
  draft_s(num_seqs, num_tokens, context_tokens)    one draft forward, same meaning.
Implementations: `TableCost`/`TableStepCost`, step times the engine measures on a grid at start
(cached as JSON) and interpolates; `LinearCost`/`LinearStepCost`, linear in batch, tokens and
context (the engine's default without a profile, the local simulator's fit); `RooflineStepCost`
(`engine/hardware.py`), derived from datasheet presets for machines we cannot run on.
`CalibratedCost` is the one the engine steps with and reports in `EngineStats`, so the router
and the simulator price drafting as the engine does: any of those as its base, plus the
per-sequence overhead the engine learns while serving.

`choose_k` picks per-sequence speculation lengths for one step by maximising batch goodput,
expected emitted tokens over step time, with `expected_tokens(a, k) = (1 - a^(k+1)) / (1 - a)`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Protocol, Sequence

def expected_tokens(a: float, k: int) -> float:
    """Expected tokens one step emits for a sequence: accepted draft tokens + 1 (recovered/bonus).

    Assumes each draft token is accepted independently with probability a (Leviathan et al.).
    """
    if k <= 0 or a <= 0.0:
        return 1.0
    if a >= 1.0 - 1e-12:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class StepCostModel(Protocol):
    def target_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float: ...

    def draft_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float: ...


# ----------------------------------------------------------------------------- fitted (linear)


@dataclass
class LinearCost:
    """seconds = fixed_s + per_seq_s * num_seqs + per_token_s * num_tokens + per_ctx_token_s * ctx."""

    fixed_s: float
    per_seq_s: float
    per_token_s: float
    per_ctx_token_s: float = 0.0

    def __call__(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        return (self.fixed_s + self.per_seq_s * num_seqs + self.per_token_s * num_tokens
                + self.per_ctx_token_s * context_tokens)


@dataclass
class LinearStepCost:
    """A StepCostModel from two fitted LinearCosts; the engine caches it as JSON."""

    target: LinearCost
    draft: LinearCost

    def target_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        return self.target(num_seqs, num_tokens, context_tokens)

    def draft_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        return self.draft(num_seqs, num_tokens, context_tokens)

    def to_dict(self) -> dict:
        return {"target": asdict(self.target), "draft": asdict(self.draft)}

    @classmethod
    def from_dict(cls, d: dict) -> "LinearStepCost":
        return cls(target=LinearCost(**d["target"]), draft=LinearCost(**d["draft"]))




@dataclass
class TableCost:
    """seconds measured on a grid, interpolated: rows by num_seqs, points by tokens per sequence.

    A linear fit cannot hold a step whose cost is flat while the matmuls are bound by reading
    weights and then grows once they are bound by compute (on the CPU with oneDNN, 1 to 8 query
    tokens of one sequence cost nearly the same); the table keeps that shape. Between grid
    points it interpolates linearly; beyond them it extrapolates the last segment.
    rows: {num_seqs: [(tokens_per_seq, seconds), ...]} with at least one row of two points.
    """

    rows: dict[int, list[tuple[float, float]]]

    def __post_init__(self) -> None:
        self.rows = {int(n): sorted((float(q), float(t)) for q, t in pts)
                     for n, pts in self.rows.items()}
        self._seqs = sorted(self.rows)

    @staticmethod
    def _interp(points: list[tuple[float, float]], x: float) -> float:
        if len(points) == 1:
            return points[0][1]
        i = 1
        while i < len(points) - 1 and points[i][0] < x:
            i += 1
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))

    def __call__(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        if num_seqs <= 0:
            return 0.0
        per_seq = num_tokens / num_seqs
        row = {n: self._interp(self.rows[n], per_seq) for n in self._seqs}
        return self._interp([(float(n), row[n]) for n in self._seqs], float(num_seqs))

    @classmethod
    def measure_grid(cls, samples: Sequence[tuple[int, int, int, float]]) -> "TableCost":
        """From (num_seqs, num_tokens, context_tokens, seconds) samples on a grid."""
        rows: dict[int, list[tuple[float, float]]] = {}
        for n, t, _, secs in samples:
            rows.setdefault(n, []).append((t / n, secs))
        return cls(rows)


@dataclass
class TableStepCost:
    """A StepCostModel from two measured tables; the engine caches it as JSON."""

    target: TableCost
    draft: TableCost | None = None

    def target_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        return self.target(num_seqs, num_tokens, context_tokens)

    def draft_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        return self.draft(num_seqs, num_tokens, context_tokens) if self.draft else 0.0

    def to_dict(self) -> dict:
        return {"kind": "table", "target": {str(n): p for n, p in self.target.rows.items()},
                "draft": {str(n): p for n, p in self.draft.rows.items()} if self.draft else None}

    @classmethod
    def from_dict(cls, d: dict) -> "TableStepCost":
        return cls(TableCost(d["target"]), TableCost(d["draft"]) if d.get("draft") else None)


def step_cost_from_dict(d: dict):
    """Read back a measured or calibrated cost model from its `to_dict()`."""
    if d.get("kind") == "calibrated":
        return CalibratedCost(step_cost_from_dict(d["base"]), d["per_seq_s"], d.get("spec_scale", 1.0),
                              draft_excess=bool(d.get("draft_excess")))
    return TableStepCost.from_dict(d) if d.get("kind") == "table" else LinearStepCost.from_dict(d)


OVERHEAD_EWMA = 0.1       # CalibratedCost.calibrate without draft_excess: weight of one step
DRAFT_FORGET = 0.9         # ... draft_excess: weight of the past per drafting step
CAL_FORGET = 0.98          # ... draft_excess: per_seq_s's weight of the past per decode step
CAL_SCALE_RANGE = (0.25, 4.0)
PER_SEQ_PRIOR = 32.0       # ... draft_excess: per_seq_s's prior of 0, weighted as 32 batch-1 steps
SCALE_RELAX = 0.02         # ... draft_excess: spec_scale's pull back to 1 per step nobody drafts
                           #     at another load than it was learnt at
# The engine drafts only where `choose_k` expects that to beat plain decoding by this much: the
# model's error at large batch is about that, and it does not see what a closed batch loses to
# sequences finishing unevenly (docs/decisions/0009-k-rule.md).
MIN_GAIN = 0.05
# ... and where a sequence runs alone, neither holds: the profile is taken at batch 1 and there is
# no batch to finish unevenly. Alone it drafts where that pays 2%, the margin the router asks of
# a request alone (`router.policy.PolicyConfig.min_gain`); at 5% a lone request whose drafting
# pays 2-5% would decode plainly (docs/decisions/0009-k-rule.md).
MIN_GAIN_ALONE = 0.02
PAYBACK_STEPS = 32   # a draft's catch-up pays back within the sequence's steps left, at most this
CATCH_UP_MAX = 3     # draft tokens to catch up on that still make a decode step (calibration's)


@dataclass
class CalibratedCost:
    """The step cost the engine runs on: a base model (profiled table, linear or roofline) plus
    what the engine learns while serving (`LLMEngine._calibrate`, `calibrate` below):
      - per_seq_s: the per-sequence overhead of a real step (scheduling, sampling, detokenizing,
        attention over longer contexts), paid with or without drafting;
      - spec_scale: how much dearer (> 1) or cheaper (< 1) drafting really is than the base
        prices it, applied to every draft forward. A base model that misprices the draft
        (a profile on another load, a datasheet roofline) would otherwise mislead both the
        engine's k and the router's tier choice, in whichever direction it errs.

    The one cost model class: the engine steps with it, reports it in `EngineStats`, and the
    router's policy and the simulator price drafting with the same object.
    """

    base: StepCostModel
    per_seq_s: float = 0.0
    spec_scale: float = 1.0
    # The engine (and the simulator's engines): spec_scale = what drafting took (its rounds and
    # its tokens' share of the verify forward's excess, timed apart by the engine; see
    # `calibrate`) / the base's price for the rounds, a forgetful regression through the origin
    # over drafting steps (DRAFT_FORGET), within CAL_SCALE_RANGE; per_seq_s from what every
    # decode step costs beyond that and the base's prices (a regression of the residual on the
    # batch size, through the origin). The draft's own excess (Python per round and sequence,
    # the catch-up token) stays the draft's: charged per sequence it would price plain steps
    # far above their cost and make drafting look cheap (docs/decisions/0010-cost-calibration.md).
    draft_excess: bool = False

    def __post_init__(self) -> None:
        self._sxy = self._sxx = 0.0                # draft_excess: the regressions' sums
        self._scale_n: float | None = None         # ... and the batch spec_scale was learnt at
        self._pxy = self._pxx = 0.0

    def target_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        return self.base.target_s(num_seqs, num_tokens, context_tokens) + self.per_seq_s * num_seqs

    def draft_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        return self.spec_scale * self.base.draft_s(num_seqs, num_tokens, context_tokens)

    def calibrate(self, ks: Sequence[int], context_tokens: int, seconds: float,
                  could_draft: bool = True, draft_seconds: float | None = None,
                  verify_seconds: float | None = None) -> None:
        """Learn from one decode step (every sequence fed one token, sequence i drafting ks[i])
        that took `seconds`. Model: seconds = base verify forward + per_seq * n
        + spec_scale * (the base's draft rounds). Without draft_excess only per_seq moves (an
        EWMA of the residual a sequence). per_seq stays >= 0 (a base that overprices the target
        stays overpriced), spec_scale within CAL_SCALE_RANGE. could_draft: some sequence of
        the step is speculative (draft_excess: only then does a step without drafting pull
        spec_scale back, see below). A joint least-squares fit of both terms on the step's total
        cannot tell them apart at a steady batch, hence the two regressions.

        draft_seconds, verify_seconds (draft_excess; the engine times a step's draft rounds and
        its verify forward apart): a drafting step then prices the draft at what its rounds
        took, plus the verify forward's excess over the base on the drafted tokens' share of it
        (the forward's measured / priced time, applied to what the drafts add to the price);
        the rest, the time outside both and the excess on the plain share, teaches per_seq_s
        as a plain step does. Without them, whatever a drafting step costs beyond the prices
        and per_seq_s is the draft's: under serving that charges the draft with the time the
        replica's other threads and processes take from the step, and an all-speculative load,
        which has no plain step to learn per_seq_s from, holds spec_scale at its ceiling.
        Pricing the draft from its rounds alone, without its share of the verify, drafts where
        drafting does not pay. The alternatives and their figures:
        docs/decisions/0010-cost-calibration.md."""
        n = len(ks)
        if self.draft_excess and any(ks):
            verify = self.base.target_s(n, n + sum(ks), context_tokens)
            drafting = step_s(ks, self.base, context_tokens) - verify
            timed = draft_seconds is not None and verify_seconds is not None and verify > 0
            if timed:
                plain = self.base.target_s(n, n, context_tokens)
                over = verify_seconds / verify - 1.0       # the verify forward's excess, relative
                self._learn_per_seq(n, max(0.0, seconds - draft_seconds - verify_seconds
                                            + over * plain))
            if drafting > 0:
                observed = (draft_seconds + max(0.0, over * (verify - plain)) if timed
                            else max(0.0, seconds - verify - self.per_seq_s * n))
                self._sxy = DRAFT_FORGET * self._sxy + drafting * observed
                self._scale_n = n if self._scale_n is None else (
                    DRAFT_FORGET * self._scale_n + (1 - DRAFT_FORGET) * n)
                self._sxx = DRAFT_FORGET * self._sxx + drafting * drafting
                lo, hi = CAL_SCALE_RANGE
                self.spec_scale = min(hi, max(lo, self._sxy / self._sxx))
            return
        if self.draft_excess:
            # Plain steps: residual = per_seq * n through the origin, weighted by n (forgetful):
            # a fixed excess seen at a small batch (a draining batch of 2) must not become a
            # per-sequence price at batch 32.
            # The prior (per_seq 0, PER_SEQ_PRIOR, never forgotten) keeps one step from setting
            # the price: a process's first decode step pays first-use costs, and a
            # speculative-only load has no later plain step to correct a price learnt from it
            # (docs/decisions/0010-cost-calibration.md).
            self._learn_per_seq(n, max(0.0, seconds - step_s(ks, self.base, context_tokens)))
            # Speculative sequences at a load other than the one the draft's price was learnt
            # at (under half or over twice that batch), and nobody drafts: the price is not
            # being measured, so it drifts back to the profile's (spec_scale 1). A price learnt
            # at one load (drafting dear at batch 32) would otherwise hold k at 0 for good once
            # load falls: nothing drafts, so nothing corrects it. At the same load the price
            # stays: drifting there would make k = 0 retry drafting every few dozen steps, each
            # retry a catch-up prefill (docs/decisions/0010-cost-calibration.md).
            # A price still true is learnt again by the first drafting steps (DRAFT_FORGET).
            # Steps of baseline sequences alone keep it: no choice is stuck.
            learnt_at = n if self._scale_n is None else self._scale_n
            if not could_draft or learnt_at / 2 <= n <= 2 * learnt_at:
                return
            self._sxx *= DRAFT_FORGET
            self.spec_scale += SCALE_RELAX * (1.0 - self.spec_scale)
            self._sxy = self.spec_scale * self._sxx
            return
        residual = max(0.0, seconds - step_s(ks, self.base, context_tokens)) / n
        self.per_seq_s += OVERHEAD_EWMA * (residual - self.per_seq_s)

    def _learn_per_seq(self, n: int, residual: float) -> None:
        """draft_excess: one step's time beyond the priced forwards, `residual` seconds at n
        sequences, into per_seq_s (a forgetful regression through the origin, weighted by n,
        against a prior of 0; see `calibrate`)."""
        self._pxy = CAL_FORGET * self._pxy + n * residual
        self._pxx = CAL_FORGET * self._pxx + n * n
        self.per_seq_s = self._pxy / (self._pxx + PER_SEQ_PRIOR)

    def to_dict(self) -> dict:
        """JSON for reports (`specserve bench engine`); Ray carries the object itself."""
        return {"kind": "calibrated", "base": self.base.to_dict(), "per_seq_s": self.per_seq_s,
                "spec_scale": self.spec_scale, "draft_excess": self.draft_excess}


# ----------------------------------------------------------------------------- choosing k


def step_s(ks: Sequence[int], cost: StepCostModel, context_tokens: int = 0, extra_tokens: int = 0,
           counts: Sequence[int] | None = None) -> float:
    """Time of one step where sequence i drafts ks[i] tokens (counts[i] sequences alike, if given).

    max(ks) draft rounds, round j over the n_j sequences with k >= j, then one target verify
    over all sequences carrying sum(k + 1) + extra_tokens query tokens.
    """
    counts = [1] * len(ks) if counts is None else counts
    batch = sum(counts)
    drafted = sum(c * k for c, k in zip(counts, ks))
    total = cost.target_s(batch, batch + drafted + extra_tokens, context_tokens)
    for j in range(1, max(ks, default=0) + 1):
        n_j = sum(c for c, k in zip(counts, ks) if k >= j)
        total += cost.draft_s(n_j, n_j, context_tokens * n_j // batch)
    return total


def step_parts(cost: StepCostModel, ks: Sequence[int], num_seqs: int, query_tokens: int,
               first_round_tokens: int, context_tokens: int = 0) -> tuple[float, float]:
    """(draft rounds, verify forward) of one step as run: `num_seqs` sequences in the verify
    forward carrying `query_tokens` (prompt chunks, fed tokens and drafts), max(ks) draft
    rounds, round j over the n_j sequences with k >= j, the first of them feeding
    `first_round_tokens` (what each draft had not read yet: one token when on time, a prompt
    it never saw). The engine prices each step it runs with this (`ServingTimes`, what the
    served steps took against their profile) and the simulator's engines time theirs."""
    verify = cost.target_s(num_seqs, query_tokens, context_tokens)
    drafting = 0.0
    for j in range(1, max(ks, default=0) + 1):
        n_j = sum(1 for k in ks if k >= j)
        drafting += cost.draft_s(n_j, first_round_tokens if j == 1 else n_j,
                                 context_tokens * n_j // max(num_seqs, 1))
    return drafting, verify


def choose_k(acceptance: Sequence[float], k_max: Sequence[int], cost: StepCostModel,
             context_tokens: int = 0, extra_tokens: int = 0,
             max_slowdown: float | None = 0.05,
             catch_up_s: Sequence[float] | None = None, min_gain: float = 0.0,
             no_split: bool = False) -> list[int]:
    """Per-sequence speculation length for one step, maximising batch goodput.

    goodput = sum_i expected_tokens(a_i, k_i) / decode time. A step (`step_s`) is max(k) draft
    rounds, round j over the n_j = #{i: k_i >= j} sequences, then one target verify over
    sum_i (k_i + 1) + extra_tokens query tokens. extra_tokens is chunked prefill riding in the
    same forward; its own cost, target_s(B, B + extra) - target_s(B, B), is spent anyway and is
    not charged to decoding, so speculation must pay against decode time alone.
    a_i is sequence i's per-token acceptance; k_max[i] = 0 marks a sequence in baseline mode.

    max_slowdown: the p95 guard. No sequence, speculative or baseline mode, may expect fewer
    than (1 - max_slowdown) of the tokens per second it would get with k = 0 for all:
    expected_tokens(a_i, k_i) >= (1 - max_slowdown) * step time / step time at k = 0. So a step
    speculates only when its lowest-acceptance sequence loses at most that much, and a
    baseline-mode sequence (one token a step) vetoes draft rounds that would slow it more.
    None: pure goodput, whoever pays.

    catch_up_s[i]: what sequence i adds to the step if it drafts at all, for its draft to catch
    up on tokens it skipped while it did not draft (0 for a draft on time). A sequence stopped
    while acceptance sat near break-even otherwise restarts on the next small move of its
    estimate, the whole batch at once, each draft feeding every token it skipped, and stops
    again a few steps later.

    min_gain: drafting is chosen only if its goodput beats plain decoding's by this fraction.
    no_split: if any sequence drafts, every speculative one does (k >= 1): in a batch split into
    drafting and not, the ones not drafting advance a token a step while the rest advance
    1 + a, so they finish later and alone, and they wait out every draft round for nothing
    (docs/decisions/0009-k-rule.md).

    Sequences with equal (a, k_max, catch-up) are solved as one group. For each cap
    K = 1..max(k_max), a Dinkelbach iteration on the linearised cost: every group takes the
    largest k <= K whose marginal gain a^k beats lambda * (marginal cost per draft token);
    lambda is then the exact goodput. Candidates are those choices, the same with speculative
    zeros lifted to 1, and k = K for all; the best feasible one wins (all-zero otherwise). The
    caps stop after two in a row fail to improve (goodput is unimodal in the cap in practice).
    A higher a never gets a smaller k.
    """
    batch = len(acceptance)
    if batch == 0:
        return []
    catch_up = [0.0] * batch if catch_up_s is None else catch_up_s
    keys = [(min(max(float(a), 0.0), 1.0), max(int(km), 0), max(float(c), 0.0))
            for a, km, c in zip(acceptance, k_max, catch_up)]
    counts: dict[tuple[float, int, float], int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    groups = list(counts)
    k_top = max(km for _, km, _ in groups)
    if k_top == 0:
        return [0] * batch
    sizes = [counts[g] for g in groups]
    accs = [a for a, _, _ in groups]
    cost = _Memo(cost)    # one call asks the same few table points hundreds of times
    gains = [[expected_tokens(a, k) for k in range(k_top + 1)] for a in accs]
    logs = [math.log(a) if 0.0 < a < 1.0 else 0.0 for a in accs]
    base_s = cost.target_s(batch, batch + extra_tokens, context_tokens)
    prefill_s = base_s - cost.target_s(batch, batch, context_tokens) if extra_tokens else 0.0

    rates: dict[tuple[int, ...], float] = {}

    def evaluate(ks: list[int]) -> float:
        """Goodput of ks, or 0.0 if it slows some sequence by more than max_slowdown."""
        key = tuple(ks)
        if key in rates:
            return rates[key]
        # `step_s`, in one pass over the groups (this runs ~100 times a step)
        drafting = [0] * (k_top + 2)      # drafting[k]: sequences with exactly k draft tokens
        emitted = seconds = 0.0
        for g, k, c, (_, _, cu) in zip(gains, ks, sizes, groups):
            drafting[k] += c
            emitted += c * g[k]
            if k:
                seconds += c * cu
        n_j = sum(drafting[1:])
        seconds += cost.target_s(batch, batch + sum(k * n for k, n in enumerate(drafting))
                                 + extra_tokens, context_tokens)
        for j in range(1, k_top + 1):
            if not n_j:
                break
            seconds += cost.draft_s(n_j, n_j, context_tokens * n_j // batch)
            n_j -= drafting[j]
        floor = None if max_slowdown is None else (1.0 - max_slowdown) * seconds / base_s
        rate = emitted / (seconds - prefill_s)
        if floor is not None and any(g[k] < floor for g, k in zip(gains, ks)):
            rate = 0.0
        rates[key] = rate
        return rate

    best_ks = [0] * len(groups)
    best_rate = evaluate(best_ks)
    d_one = cost.draft_s(1, 1, context_tokens // batch)
    d_slope = (cost.draft_s(batch, batch, context_tokens) - d_one) / (batch - 1) if batch > 1 else 0.0
    misses = 0
    for cap in range(1, k_top + 1):
        t_cap = cost.target_s(batch, batch * (cap + 1) + extra_tokens, context_tokens)
        t_slope = (t_cap - base_s) / (batch * cap)
        per_token_s = max(d_slope, 0.0) + max(t_slope, 0.0)
        candidates = [[min(cap, km) for _, km, _ in groups]]
        lam, improved = best_rate, False
        for _ in range(6):
            threshold = lam * per_token_s  # value of one draft token, in expected tokens
            ks = _largest_ks(accs, logs, [min(cap, km) for _, km, _ in groups], threshold)
            # A catch-up is a price for drafting at all: a group drafts only if its tokens pay
            # for it too.
            ks = [k if not cu or g[k] - 1 >= lam * (k * per_token_s + cu) else 0
                  for k, g, (_, _, cu) in zip(ks, gains, groups)]
            if ks in candidates:
                break
            candidates += [ks, [max(k, min(1, km)) for k, (_, km, _) in zip(ks, groups)]]
            lam = max(lam, evaluate(ks), evaluate(candidates[-1]))
        if no_split:
            candidates = [[max(k, min(1, km)) for k, (_, km, _) in zip(ks, groups)] if any(ks) else ks
                          for ks in candidates]
        for ks in candidates:
            r = evaluate(ks)
            if r > best_rate * (1 + 1e-12):
                best_ks, best_rate, improved = ks, r, True
        misses = 0 if improved else misses + 1
        if misses == 2:
            break
    if any(best_ks) and best_rate < evaluate([0] * len(groups)) * (1.0 + min_gain):
        best_ks = [0] * len(groups)
    by_group = dict(zip(groups, best_ks))
    return [by_group[key] for key in keys]


def catch_up_prices(cost: StepCostModel, acceptance: Sequence[float],
                    catch_up_tokens: Sequence[int], tokens_left: Sequence[int] | None,
                    context_tokens: int) -> list[float] | None:
    """`choose_k`'s catch_up_s as the engine prices it (None when no draft is behind).

    A draft behind its sequence (never run: the whole context; stopped: what it skipped) feeds
    those tokens once before it proposes: priced at the draft's cost a fed token at this batch,
    spread over the steps the sequence has left to pay it back in (its tokens left at about
    1 + a a step; None: many), at most PAYBACK_STEPS (the estimate that says drafting pays is
    a noisy one near break-even; docs/decisions/0009-k-rule.md).
    """
    if not any(catch_up_tokens):
        return None
    b = len(acceptance)
    per_token = max(0.0, cost.draft_s(b, 2 * b, context_tokens)
                    - cost.draft_s(b, b, context_tokens)) / b
    tokens_left = tokens_left or [2 * PAYBACK_STEPS] * b
    return [n * per_token / min(PAYBACK_STEPS, max(1.0, t / (1.0 + a)))
            for n, t, a in zip(catch_up_tokens, tokens_left, acceptance)]


def engine_choose_k(acceptance: Sequence[float], k_max: Sequence[int], cost: StepCostModel,
                    context_tokens: int, extra_tokens: int,
                    catch_up_s: Sequence[float] | None = None) -> list[int]:
    """k per sequence by the engine's rule (`LLMEngine._choose_k`, and the simulator's engines,
    `cluster/sim/replica.py`, through this one function): pure goodput, since the latency guard
    is the router's business (docs/architecture.md, "Choosing the tier and k"), drafting only at
    MIN_GAIN over plain decoding (MIN_GAIN_ALONE for a sequence alone), and never a batch split
    into drafting and not."""
    min_gain = MIN_GAIN if len(acceptance) > 1 else MIN_GAIN_ALONE
    return choose_k(acceptance, k_max, cost, context_tokens, extra_tokens, max_slowdown=None,
                    catch_up_s=catch_up_s, min_gain=min_gain, no_split=True)


PROBE_EVERY = 64     # steps without drafting before a probe (`DraftProbe`) ...
PROBE_EVERY_MAX = 1024   # ... doubling, up to this, while the probes do not restart drafting


class DraftProbe:
    """Exploration for an engine that has stopped drafting (`LLMEngine._choose_k` and the
    simulator's engines, `cluster/sim/replica.py`, through this one class).

    What the engine knows of drafting, its acceptance and its price (`CalibratedCost`), moves
    only with drafting steps: an engine that has stopped drafting on a stale acceptance or an
    over-priced draft would never learn that it pays again. After PROBE_EVERY steps in which no
    one drafted, the speculative sequence whose draft is least behind drafts one token (one:
    its draft may first have to catch up on everything it skipped, a step the engine does not
    calibrate on); the next step that sequence, or another whose draft is on time, drafts one
    token again: a decode step the engine calibrates on, so the probe measures the draft's price
    besides its acceptance. While probes find that drafting still does not pay, the wait before
    the next doubles (to PROBE_EVERY_MAX), so probing costs little where drafting never pays.
    What the probe recovers, and what a fixed wait costs: docs/decisions/0010-cost-calibration.md.
    """

    def __init__(self, every: int = PROBE_EVERY, every_max: int = PROBE_EVERY_MAX):
        self.every, self.every_max = every, every_max
        self.wait = every      # steps without drafting before the next probe
        self.idle = 0          # steps since anyone drafted, or since the last probe
        self.follow = False    # the last step was a probe's first: measure on the next

    def __call__(self, ks: list[int], k_max: Sequence[int],
                 catch_up_tokens: Sequence[int] | None = None) -> list[int]:
        """`ks` as chosen, or with one sequence drafting one token to probe."""
        if any(ks):
            self.idle, self.follow, self.wait = 0, False, self.every
            return ks
        self.idle += 1
        behind = catch_up_tokens or [0] * len(ks)
        speculative = [i for i, k in enumerate(k_max) if k > 0]
        if self.follow:
            self.follow = False
            on_time = [i for i in speculative if behind[i] <= CATCH_UP_MAX]
            if on_time:
                ks[on_time[0]] = 1
                return ks
        if speculative and self.idle >= self.wait:
            self.idle, self.follow = 0, True
            self.wait = min(2 * self.wait, self.every_max)
            ks[min(speculative, key=lambda i: behind[i])] = 1
        return ks


class _Memo:
    """A step cost model's answers, remembered for the length of one `choose_k` call."""

    def __init__(self, cost: StepCostModel):
        self.cost, self._t, self._d = cost, {}, {}

    def target_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        key = (num_seqs, num_tokens, context_tokens)
        if key not in self._t:
            self._t[key] = self.cost.target_s(num_seqs, num_tokens, context_tokens)
        return self._t[key]

    def draft_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        key = (num_seqs, num_tokens, context_tokens)
        if key not in self._d:
            self._d[key] = self.cost.draft_s(num_seqs, num_tokens, context_tokens)
        return self._d[key]


def _largest_ks(accs: list[float], logs: list[float], caps: list[int], threshold: float) -> list[int]:
    """Per group, the largest k <= cap whose marginal gain a^k is at least threshold
    (expected_tokens is concave in k); logs[i] = log(accs[i]) where 0 < a < 1."""
    if threshold <= 0.0:
        return [cap if cap > 0 and a > 0.0 else 0 for a, cap in zip(accs, caps)]
    if threshold >= 1.0:
        return [cap if cap > 0 and a >= 1.0 and threshold <= 1.0 else 0
                for a, cap in zip(accs, caps)]
    lt = math.log(threshold)
    return [0 if cap <= 0 or a <= 0.0 else cap if a >= 1.0
            else max(0, min(cap, int(lt / la + 1e-9)))
            for a, la, cap in zip(accs, logs, caps)]
