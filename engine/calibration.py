"""Online calibration: the step cost the engine runs on, a base model plus what it learns serving.

Owns `CalibratedCost` (a base step-cost model, `engine/step_cost.py`, plus a per-sequence
overhead and a price factor for the draft, both learnt from the steps the engine times) and the
estimator both are learnt with (`ForgetfulRatio`). Pure Python: the engine steps with it,
reports it in `EngineStats`, and the router's policy and the simulator price drafting with the
same object. Does not own: the choice of k (`engine/k_rule.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.step_cost import (LinearStepCost, StepCostModel, TableStepCost, draft_rounds,
                              price_step, step_s)

OVERHEAD_EWMA = 0.1       # CalibratedCost.calibrate without draft_excess: weight of one step
DRAFT_FORGET = 0.9         # ... draft_excess: weight of the past per drafting step
CAL_FORGET = 0.98          # ... draft_excess: per_seq_s's weight of the past per decode step
CAL_SCALE_RANGE = (0.25, 4.0)
PER_SEQ_PRIOR = 32.0       # ... draft_excess: per_seq_s's prior of 0, weighted as 32 batch-1 steps
SCALE_RELAX = 0.02         # ... draft_excess: spec_scale's pull back to 1 per step nobody drafts
                           #     at another load than it was learnt at
CATCH_UP_MAX = 3     # draft tokens to catch up on that still make a decode step (calibration's)


class ForgetfulRatio:
    """y / x by least squares through the origin over a stream of (x, y) pairs, each past pair's
    weight multiplied by `forget` at every new one, against a prior ratio of 0 weighted `prior`:
    sum(w x y) / (sum(w x^2) + prior). CalibratedCost learns per_seq_s (x the batch size, y a
    step's unpriced time) and spec_scale (x the draft's price, y what drafting took) with it."""

    def __init__(self, forget: float, prior: float = 0.0):
        self.forget, self.prior = forget, prior
        self.sxy = self.sxx = 0.0

    def observe(self, x: float, y: float) -> float:
        """Take one pair; the ratio after it."""
        self.sxy = self.forget * self.sxy + x * y
        self.sxx = self.forget * self.sxx + x * x
        return self.value

    @property
    def value(self) -> float:
        return self.sxy / (self.sxx + self.prior)

    def hold(self, ratio: float) -> None:
        """Forget one pair's worth of weight and set the ratio to `ratio` with what remains."""
        self.sxx *= self.forget
        self.sxy = ratio * (self.sxx + self.prior)


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
        # draft_excess: the two regressions, and the batch spec_scale was learnt at
        self._scale = ForgetfulRatio(DRAFT_FORGET)
        self._per_seq = ForgetfulRatio(CAL_FORGET, PER_SEQ_PRIOR)
        self._scale_n: float | None = None

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
        spec_scale back, see `_learn_plain_step`). A joint least-squares fit of both terms on
        the step's total cannot tell them apart at a steady batch, hence the two regressions.

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
            self._learn_drafting_step(ks, context_tokens, seconds, draft_seconds, verify_seconds)
        elif self.draft_excess:
            self._learn_plain_step(ks, context_tokens, seconds, could_draft)
        else:
            residual = max(0.0, seconds - step_s(ks, self.base, context_tokens)) / n
            self.per_seq_s += OVERHEAD_EWMA * (residual - self.per_seq_s)

    def _learn_drafting_step(self, ks: Sequence[int], context_tokens: int, seconds: float,
                             draft_seconds: float | None, verify_seconds: float | None) -> None:
        """draft_excess, a step in which some sequence drafted (`calibrate`)."""
        n = len(ks)
        drafting, verify = price_step(self.base, n, n + sum(ks), draft_rounds(ks), context_tokens)
        timed = draft_seconds is not None and verify_seconds is not None and verify > 0
        if timed:
            plain = self.base.target_s(n, n, context_tokens)
            over = verify_seconds / verify - 1.0       # the verify forward's excess, relative
            self._learn_per_seq(n, max(0.0, seconds - draft_seconds - verify_seconds
                                        + over * plain))
        if drafting > 0:
            observed = (draft_seconds + max(0.0, over * (verify - plain)) if timed
                        else max(0.0, seconds - verify - self.per_seq_s * n))
            self._scale_n = n if self._scale_n is None else (
                DRAFT_FORGET * self._scale_n + (1 - DRAFT_FORGET) * n)
            lo, hi = CAL_SCALE_RANGE
            self.spec_scale = min(hi, max(lo, self._scale.observe(drafting, observed)))

    def _learn_plain_step(self, ks: Sequence[int], context_tokens: int, seconds: float,
                          could_draft: bool) -> None:
        """draft_excess, a step in which nobody drafted (`calibrate`).

        Its residual = per_seq * n through the origin, weighted by n (forgetful): a fixed excess
        seen at a small batch (a draining batch of 2) must not become a per-sequence price at
        batch 32. The prior (per_seq 0, PER_SEQ_PRIOR, never forgotten) keeps one step from
        setting the price: a process's first decode step pays first-use costs, and a
        speculative-only load has no later plain step to correct a price learnt from it
        (docs/decisions/0010-cost-calibration.md).

        Speculative sequences at a load other than the one the draft's price was learnt at
        (under half or over twice that batch), and nobody drafts: the price is not being
        measured, so it drifts back to the profile's (spec_scale 1). A price learnt at one load
        (drafting dear at batch 32) would otherwise hold k at 0 for good once load falls:
        nothing drafts, so nothing corrects it. At the same load the price stays: drifting there
        would make k = 0 retry drafting every few dozen steps, each retry a catch-up prefill
        (docs/decisions/0010-cost-calibration.md). A price still true is learnt again by the
        first drafting steps (DRAFT_FORGET). Steps of baseline sequences alone keep it: no
        choice is stuck.
        """
        n = len(ks)
        self._learn_per_seq(n, max(0.0, seconds - step_s(ks, self.base, context_tokens)))
        learnt_at = n if self._scale_n is None else self._scale_n
        if not could_draft or learnt_at / 2 <= n <= 2 * learnt_at:
            return
        self.spec_scale += SCALE_RELAX * (1.0 - self.spec_scale)
        self._scale.hold(self.spec_scale)

    def _learn_per_seq(self, n: int, residual: float) -> None:
        """draft_excess: one step's time beyond the priced forwards, `residual` seconds at n
        sequences, into per_seq_s (see `_learn_plain_step`)."""
        self.per_seq_s = self._per_seq.observe(n, residual)

    def to_dict(self) -> dict:
        """JSON for reports (`specserve bench engine`); Ray carries the object itself."""
        return {"kind": "calibrated", "base": self.base.to_dict(), "per_seq_s": self.per_seq_s,
                "spec_scale": self.spec_scale, "draft_excess": self.draft_excess}


def step_cost_from_dict(d: dict):
    """Read back a measured or calibrated cost model from its `to_dict()`."""
    if d.get("kind") == "calibrated":
        return CalibratedCost(step_cost_from_dict(d["base"]), d["per_seq_s"], d.get("spec_scale", 1.0),
                              draft_excess=bool(d.get("draft_excess")))
    return TableStepCost.from_dict(d) if d.get("kind") == "table" else LinearStepCost.from_dict(d)
