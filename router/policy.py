"""The tier policy: which tier serves a request, with which k cap, and why.

`choose_tier(request, stats, state) -> Decision` is a pure function: the live router and the
capacity simulator run this same code. Hysteresis lives in the explicit `PolicyState` carried
in and out (`decision.state` is the state for the next call); there are no globals.
Imports neither torch nor Ray; knows nothing about HTTP, replicas or how stats are gathered.

Rules, first match wins (reasons are machine-readable and returned to the caller):
  small tier cold (scaled to zero), plan economy -> baseline  small_cold  (at the economy
                           price; the ingress wakes the small tier)
  small tier down, plan economy -> baseline  tier_down  (at the economy price)
  target down, the caller allows a downgrade, small up -> small  tier_down
                           (else the request goes to the target, whose replica answers 503
                           with the expected recovery as Retry-After)
  plan economy           -> small      plan_economy      (never speculates, so `off` holds)
  speculation=off        -> baseline   speculation_off   (always honoured)
  premium / speculation=on -> speculative plan_premium | speculation_on, unless the target
                           has no draft (no_draft) or too little KV headroom (kv_headroom)
  queue deep (hysteresis)-> small, if the caller allows a downgrade and the small tier is
                           up with a shorter queue                            queue_deep
  plan standard          -> baseline   plan_standard
  plan auto              -> baseline   no_draft | kv_headroom | drafting_loses (the engine
                           measured drafting delivering less than plain decoding at its live
                           acceptance, engine/goodput.py) | acceptance_low, else
                           speculative speculation_pays: the request's class pays alone on the
                           replica's profile (`speculation_gain` of it alone >= min_gain), and
                           the engine's adaptive k then decides each step, at every batch,
                           whether and how far to draft (k = 0 is plain decoding); a request
                           the caller drew as a probe (`probe_share` of them) speculates where
                           acceptance_low or drafting_loses would send it to baseline
                           (acceptance_probe, drafting_probe): a class's acceptance, and the
                           engine's verdict on drafting, are learnt only from speculative
                           requests, so without probes neither is measured again once low.
No load gate for auto beyond memory, and a deep queue does not send auto to baseline: a queue
says the batch is full, and at a full batch the engine's per-step k already drafts only where
that pays; a router guessing the same from a second-hand cost model lags it. The per-request
test prices drafting at the replica's profile, not at a price learnt under load (see
`choose_tier`). Each of these rules, and the alternatives it was measured against:
docs/decisions/0017-tier-policy.md.
The small tier is a quality trade: only economy, or a caller who set allow_downgrade, gets it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from engine.k_rule import engine_choose_k, expected_tokens
from engine.step_cost import step_s
from router.stats import ClusterStats, TierStats

PLANS = ("premium", "standard", "economy", "auto")
SPECULATION = ("auto", "on", "off")
TIERS = ("speculative", "baseline", "small")
REASONS = ("speculation_off", "plan_economy", "plan_premium", "speculation_on", "no_draft",
           "kv_headroom", "queue_deep", "plan_standard", "drafting_loses", "acceptance_low",
           "speculation_pays", "tier_down", "small_cold", "acceptance_probe", "drafting_probe")
PROBES = ("acceptance_probe", "drafting_probe")     # speculating to measure: priced at baseline


@dataclass(frozen=True)
class TierRequest:
    """What the policy needs to know about one request (the ingress builds it from the API)."""

    plan: str = "auto"
    speculation: str = "auto"  # request field: auto | on | off
    allow_downgrade: bool = False  # caller opts into the small tier's quality trade
    prompt_class: str = "chat"  # code | chat | qa | creative (see classify_prompt)
    prompt_tokens: int = 0
    max_tokens: int = 256
    probe: bool = False  # drawn by the caller with probability `PolicyConfig.probe_share`

    def __post_init__(self) -> None:
        if self.plan not in PLANS:
            raise ValueError(f"plan must be one of {PLANS}, got {self.plan!r}")
        if self.speculation not in SPECULATION:
            raise ValueError(f"speculation must be one of {SPECULATION}, got {self.speculation!r}")
        if self.prompt_tokens < 0 or self.max_tokens < 1:
            raise ValueError("prompt_tokens must be >= 0 and max_tokens >= 1")


@dataclass(frozen=True)
class PolicyState:
    """Hysteresis memory: whether the target's queue counted as deep at the last decision."""

    queue_deep: bool = False  # target queue currently counted as deep


@dataclass(frozen=True)
class PolicyConfig:
    k_max: int = 8  # cap on k for speculative decisions; the engine picks k <= it per step
    min_gain: float = 1.02  # predicted goodput ratio (speculating / not) of the request alone
    #   below which auto keeps it off the draft (a speculative admission costs a draft prefill
    #   and draft KV, so a gain within a few percent of 1 does not pay for it)
    queue_deep_enter: int = 8  # queued requests at which the target counts as saturated
    queue_deep_exit: int = 2  # ... and at or below which it no longer does
    kv_low_water: float = 0.10  # fraction of the KV budget a speculative admission must leave free
    default_acceptance: float = 0.6  # prior when a prompt class has no live estimate yet
    probe_share: float = 0.02  # auto requests drawn as probes: they speculate where their
    #   class's acceptance or the engine's verdict says drafting does not pay, so both keep
    #   being measured (each is learnt from speculative requests alone)

    def __post_init__(self) -> None:
        """Checked where the config is loaded (`router.config.AppConfig.policy`)."""
        if not 0 <= self.k_max <= 16:
            raise ValueError(f"policy.k_max must be in [0, 16], got {self.k_max}")
        if not self.min_gain > 0:
            raise ValueError(f"policy.min_gain must be > 0, got {self.min_gain}")
        if not 0 <= self.kv_low_water < 1:
            raise ValueError("policy.kv_low_water must be in [0, 1)")
        if not 0 <= self.queue_deep_exit < self.queue_deep_enter:
            raise ValueError(f"policy needs 0 <= queue_deep_exit < queue_deep_enter, got "
                             f"{self.queue_deep_exit} and {self.queue_deep_enter}")
        if not 0 < self.default_acceptance < 1:
            raise ValueError("policy.default_acceptance must be in (0, 1)")
        if not 0 <= self.probe_share <= 1:
            raise ValueError(f"policy.probe_share must be in [0, 1], got {self.probe_share}")


@dataclass(frozen=True)
class Decision:
    tier: str  # speculative | baseline | small
    k_max: int  # cap on k for this request (0 unless speculative)
    reason: str  # one of REASONS
    state: PolicyState  # state for the next call


def choose_tier(request: TierRequest, stats: ClusterStats, state: PolicyState,
                config: PolicyConfig = PolicyConfig()) -> Decision:
    small, target = stats.small, stats.target
    if request.plan == "economy" and small is not None and small.cold and target.available:
        return Decision("baseline", 0, "small_cold", state)
    if request.plan == "economy" and small is not None and not small.available \
            and target.available:
        return Decision("baseline", 0, "tier_down", state)
    if not target.available and request.allow_downgrade and small is not None \
            and small.available:
        return Decision("small", 0, "tier_down", state)
    if request.plan == "economy":       # the small tier never speculates: `off` holds there too
        return Decision("small", 0, "plan_economy", state)
    if request.speculation == "off":
        return Decision("baseline", 0, "speculation_off", state)
    if request.plan == "premium" or request.speculation == "on":
        blocked = _speculation_blocked(request, target, config)
        if blocked:
            return Decision("baseline", 0, blocked, state)
        reason = "plan_premium" if request.plan == "premium" else "speculation_on"
        return Decision("speculative", config.k_max, reason, state)

    if state.queue_deep:
        deep = target.queue_depth > config.queue_deep_exit
    else:
        deep = target.queue_depth >= config.queue_deep_enter
    state = replace(state, queue_deep=deep)
    if deep and request.allow_downgrade and stats.small is not None and stats.small.available \
            and stats.small.queue_depth < target.queue_depth:
        return Decision("small", 0, "queue_deep", state)
    if request.plan == "standard":
        return Decision("baseline", 0, "plan_standard", state)

    blocked = _speculation_blocked(request, target, config)
    if blocked:
        return Decision("baseline", 0, blocked, state)
    if target.drafting_loses:          # measured, not predicted: the model missed something
        if request.probe:              # the engine re-judges drafting only where some drafts
            return Decision("speculative", config.k_max, "drafting_probe", state)
        return Decision("baseline", 0, "drafting_loses", state)
    a = target.acceptance_by_class.get(request.prompt_class, config.default_acceptance)
    # Whether this class's acceptance pays for drafting, priced at the replica's profile: what
    # a replica learns while serving (`CalibratedCost`: the draft's price factor, the per-
    # sequence overhead) describes the batches it ran, and is the engine's to act on per step.
    # Priced with it, a draft price learnt at a large batch makes a lone request look
    # unpaying, every auto request goes to baseline, no sequence drafts, and the price is never
    # measured again (docs/decisions/0017-tier-policy.md).
    profiled = replace(target, cost=getattr(target.cost, "base", target.cost))
    alone = speculation_gain(profiled, a, config.k_max, request.prompt_tokens, request.max_tokens,
                             alone=True)
    if alone < config.min_gain:
        if request.probe:
            return Decision("speculative", config.k_max, "acceptance_probe", state)
        return Decision("baseline", 0, "acceptance_low", state)
    return Decision("speculative", config.k_max, "speculation_pays", state)


def _speculation_blocked(request: TierRequest, target: TierStats, config: PolicyConfig) -> str:
    """'' if the target can take this request in speculative mode, else the reason it cannot."""
    if not target.can_speculate:
        return "no_draft"
    kv_tokens = request.prompt_tokens + request.max_tokens
    need = kv_tokens * (target.target_kv_bytes_per_token + target.draft_kv_bytes_per_token)
    if target.kv_headroom_bytes - need < config.kv_low_water * target.kv_budget_bytes:
        return "kv_headroom"
    return ""


def speculation_gain(target: TierStats, a: float, k_max: int, prompt_tokens: int = 0,
                     max_tokens: int = 256, alone: bool = False) -> float:
    """Predicted tokens per second with the batch speculating, over the same batch not.

    The batch is this request (acceptance a) alone, or with the running ones as if all were
    speculative: typical members at the median of the recent acceptance samples and one at
    their 1/(B+1) quantile, the lowest acceptance a batch of B+1 can expect. k is the engine's
    own choice for that batch (`engine_choose_k`: goodput, drafting only at its MIN_GAIN, no
    split batches), so the router predicts what the engine will do, not a stricter rule of its
    own (docs/decisions/0009-k-rule.md).
    Time per output token = decode step / tokens per step + prefill / output length: every
    request's prompt goes through the target once (both modes), and through the draft once
    when it speculates. 1.0 or less: speculation does not pay.
    """
    if not target.can_speculate:
        return 0.0
    batch = 1 if alone else target.decode_batch_size + 1
    acceptance = [a]
    if batch > 1:
        samples = sorted(target.acceptance_samples) or [a]
        acceptance += [samples[len(samples) // 2]] * (batch - 2) + [samples[len(samples) // batch]]
    cost = target.cost
    ctx = prompt_tokens + (0 if alone else target.context_tokens)
    ks = engine_choose_k(acceptance, [k_max] * batch, cost, ctx, 0)
    if not any(ks):
        return 1.0
    emitted = sum(expected_tokens(x, k) for x, k in zip(acceptance, ks))
    output_tokens = target.mean_output_tokens or max_tokens
    prefill_s = (cost.target_s(batch, batch + prompt_tokens, ctx) - cost.target_s(batch, batch, ctx))
    prefill_s /= output_tokens  # per output token
    draft_prefill_s = cost.draft_s(1, prompt_tokens) / output_tokens
    plain = step_s([0] * batch, cost, ctx) / batch + prefill_s
    return plain / (step_s(ks, cost, ctx) / emitted + prefill_s + draft_prefill_s)


_CODE = re.compile(r"```|\bdef |\bclass |\bimport |\bfunction\b|\breturn\b|[{};]\s*$|\bSELECT\b", re.M)
_CREATIVE = re.compile(r"\b(story|poem|poetry|lyrics|fiction|imagine|haiku|novel|screenplay)\b", re.I)
_QUESTION = re.compile(r"^\s*(what|who|when|where|why|how|which|is|are|does|do|can)\b", re.I)


def classify_prompt(text: str) -> str:
    """Cheap prompt class for acceptance statistics: code, creative, qa or chat."""
    if _CODE.search(text):
        return "code"
    if _CREATIVE.search(text):
        return "creative"
    if text.rstrip().endswith("?") or _QUESTION.match(text):
        return "qa"
    return "chat"

