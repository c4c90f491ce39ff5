"""The k rule: how many draft tokens each sequence proposes in a step, and its exploration.

`choose_k` picks per-sequence speculation lengths for one step by maximising batch goodput,
expected emitted tokens over step time (`engine/step_cost.py: price_step`), with
`expected_tokens(a, k) = (1 - a^(k+1)) / (1 - a)`. `engine_choose_k` is the engine's use of it,
`catch_up_prices` what it charges a draft that is behind, and `DraftProbe` the exploration that
lets an engine which has stopped drafting learn that drafting pays again. The engine
(`LLMEngine._choose_k`), the simulator's engines (`cluster/sim/replica.py`) and the router's
policy all call these. Pure Python. Does not own: the step-cost models (`engine/step_cost.py`)
nor their calibration (`engine/calibration.py`).
"""

from __future__ import annotations

import math
from typing import Sequence

from engine.calibration import CATCH_UP_MAX
from engine.step_cost import StepCostModel, price_step


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens one step emits for a sequence: accepted draft tokens + 1 (recovered/bonus).

    Assumes each draft token is accepted independently with probability a (Leviathan et al.).
    """
    if k <= 0 or a <= 0.0:
        return 1.0
    if a >= 1.0 - 1e-12:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


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


def choose_k(acceptance: Sequence[float], k_max: Sequence[int], cost: StepCostModel,
             context_tokens: int = 0, extra_tokens: int = 0,
             max_slowdown: float | None = 0.05,
             catch_up_s: Sequence[float] | None = None, min_gain: float = 0.0,
             no_split: bool = False) -> list[int]:
    """Per-sequence speculation length for one step, maximising batch goodput.

    goodput = sum_i expected_tokens(a_i, k_i) / decode time. A step (`price_step`) is max(k) draft
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
    if len(acceptance) == 0:
        return []
    catch_up = [0.0] * len(acceptance) if catch_up_s is None else catch_up_s
    keys = [(min(max(float(a), 0.0), 1.0), max(int(km), 0), max(float(c), 0.0))
            for a, km, c in zip(acceptance, k_max, catch_up)]
    if max(km for _, km, _ in keys) == 0:
        return [0] * len(keys)
    search = _KSearch(keys, cost, context_tokens, extra_tokens, max_slowdown)
    best_ks, best_rate = search.best(no_split)
    if any(best_ks) and best_rate < search.rate([0] * len(best_ks)) * (1.0 + min_gain):
        best_ks = [0] * len(best_ks)
    by_group = dict(zip(search.groups, best_ks))
    return [by_group[key] for key in keys]


class _KSearch:
    """`choose_k`'s search over one step's groups of alike sequences (equal a, k_max, catch-up).

    groups[g] = (a, k_max, catch-up seconds), sizes[g] its sequences, gains[g][k] =
    expected_tokens(a, k); a candidate is one k per group.
    """

    def __init__(self, keys: list[tuple[float, int, float]], cost: StepCostModel,
                 context_tokens: int, extra_tokens: int, max_slowdown: float | None):
        counts: dict[tuple[float, int, float], int] = {}
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
        self.groups = list(counts)
        self.sizes = [counts[g] for g in self.groups]
        self.batch = len(keys)
        self.k_top = max(km for _, km, _ in self.groups)
        self.accs = [a for a, _, _ in self.groups]
        self.gains = [[expected_tokens(a, k) for k in range(self.k_top + 1)] for a in self.accs]
        self.logs = [math.log(a) if 0.0 < a < 1.0 else 0.0 for a in self.accs]
        self.cost = _Memo(cost)    # one call asks the same few table points hundreds of times
        self.context, self.extra, self.max_slowdown = context_tokens, extra_tokens, max_slowdown
        self.base_s = self.cost.target_s(self.batch, self.batch + extra_tokens, context_tokens)
        self.prefill_s = (self.base_s - self.cost.target_s(self.batch, self.batch, context_tokens)
                          if extra_tokens else 0.0)
        self._rates: dict[tuple[int, ...], float] = {}

    def rate(self, ks: list[int]) -> float:
        """Goodput of ks, or 0.0 if it slows some sequence by more than max_slowdown."""
        key = tuple(ks)
        if key in self._rates:
            return self._rates[key]
        drafting = [0] * (self.k_top + 2)      # drafting[k]: sequences with exactly k draft tokens
        emitted = catch_up = 0.0
        for g, k, c, (_, _, cu) in zip(self.gains, ks, self.sizes, self.groups):
            drafting[k] += c
            emitted += c * g[k]
            if k:
                catch_up += c * cu
        rounds, n_j = [], sum(drafting[1:])     # round j's batch: the sequences with k >= j
        for j in range(1, self.k_top + 1):
            if not n_j:
                break
            rounds.append(n_j)
            n_j -= drafting[j]
        query = self.batch + sum(k * n for k, n in enumerate(drafting)) + self.extra
        draft_s, verify_s = price_step(self.cost, self.batch, query, rounds, self.context)
        seconds = catch_up + verify_s + draft_s
        rate = emitted / (seconds - self.prefill_s)
        if self.max_slowdown is not None:
            floor = (1.0 - self.max_slowdown) * seconds / self.base_s
            if any(g[k] < floor for g, k in zip(self.gains, ks)):
                rate = 0.0
        self._rates[key] = rate
        return rate

    def best(self, no_split: bool) -> tuple[list[int], float]:
        """(ks, goodput) of the best candidate over the caps K = 1..k_top (`choose_k`)."""
        best_ks = [0] * len(self.groups)
        best_rate = self.rate(best_ks)
        batch, ctx = self.batch, self.context
        d_one = self.cost.draft_s(1, 1, ctx // batch)
        d_slope = (self.cost.draft_s(batch, batch, ctx) - d_one) / (batch - 1) if batch > 1 else 0.0
        misses = 0
        for cap in range(1, self.k_top + 1):
            candidates = self._candidates(cap, best_rate, max(d_slope, 0.0))
            if no_split:
                candidates = [self._lifted(ks) if any(ks) else ks for ks in candidates]
            improved = False
            for ks in candidates:
                r = self.rate(ks)
                if r > best_rate * (1 + 1e-12):
                    best_ks, best_rate, improved = ks, r, True
            misses = 0 if improved else misses + 1
            if misses == 2:
                break
        return best_ks, best_rate

    def _candidates(self, cap: int, lam: float, d_slope: float) -> list[list[int]]:
        """Dinkelbach on the cost linearised at cap: every group takes the largest k <= cap
        whose marginal gain a^k beats lam * (marginal cost per draft token), lam then the
        exact goodput; the choices, the same with speculative zeros lifted to 1, and k = cap."""
        t_cap = self.cost.target_s(self.batch, self.batch * (cap + 1) + self.extra, self.context)
        t_slope = (t_cap - self.base_s) / (self.batch * cap)
        per_token_s = d_slope + max(t_slope, 0.0)
        caps = [min(cap, km) for _, km, _ in self.groups]
        candidates = [caps]
        for _ in range(6):
            threshold = lam * per_token_s  # value of one draft token, in expected tokens
            ks = _largest_ks(self.accs, self.logs, caps, threshold)
            # A catch-up is a price for drafting at all: a group drafts only if its tokens pay
            # for it too.
            ks = [k if not cu or g[k] - 1 >= lam * (k * per_token_s + cu) else 0
                  for k, g, (_, _, cu) in zip(ks, self.gains, self.groups)]
            if ks in candidates:
                break
            candidates += [ks, self._lifted(ks)]
            lam = max(lam, self.rate(ks), self.rate(candidates[-1]))
        return candidates

    def _lifted(self, ks: list[int]) -> list[int]:
        """ks with every speculative group drafting at least one token."""
        return [max(k, min(1, km)) for k, (_, km, _) in zip(ks, self.groups)]


def catch_up_prices(cost: StepCostModel, acceptance: Sequence[float],
                    catch_up_tokens: Sequence[int], tokens_left: Sequence[int] | None,
                    context_tokens: int) -> list[float] | None:
    """`choose_k`'s catch_up_s as the engine prices it (None when no draft is behind).

    A draft behind its sequence (never run: the whole context; stopped: what it skipped) feeds
    those tokens once before it proposes, in its first round: priced as what they add to that
    round at this batch (the draft's cost of b + n tokens less that of b), spread over the
    steps the sequence has left to pay it back in (its tokens left at about 1 + a a step;
    None: many), at most PAYBACK_STEPS (the estimate that says drafting pays is a noisy one
    near break-even; docs/decisions/0009-k-rule.md). The round's own price of its tokens, not
    the cost of one more token a sequence: that one sits where a step is bound by reading
    weights, and priced there a long prompt's catch-up would look nearly free. Each distinct
    catch-up is priced once (most drafts are on time, at 0).
    """
    if not any(catch_up_tokens):
        return None
    b = len(acceptance)
    base = cost.draft_s(b, b, context_tokens)
    fed = {n: max(0.0, cost.draft_s(b, b + n, context_tokens) - base) if n else 0.0
           for n in set(catch_up_tokens)}
    tokens_left = tokens_left or [2 * PAYBACK_STEPS] * b
    return [fed[n] / min(PAYBACK_STEPS, max(1.0, t / (1.0 + a)))
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

    def due(self) -> bool:
        """Whether the next step would probe (if no one drafts)."""
        return self.follow or self.idle + 1 >= self.wait

    def tick(self) -> None:
        """A step in which no one drafted and the k rule was not asked (drafting capped)."""
        self.idle += 1

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
