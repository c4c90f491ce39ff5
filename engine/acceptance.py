"""The one acceptance estimator: per-token acceptance a from decaying counts behind a prior.

a = accepted / trials, where a drafting step of k tokens that accepts `accepted` of them tried
`accepted + (accepted < k)` tokens (tokens after the first rejection are untried). Counts are
pooled, not per-step ratios averaged (the mean of ratios is biased low: k = 2 at a = 0.6 averages
0.48). Every estimate in the system is this class or `posterior` below, with the constants here:
  - the engine's live estimate (`LLMEngine.global_acceptance`): decay per drafting sequence-step;
  - a sequence's own estimate (the engine's adaptive k, the simulator's): its counts behind
    `SEQ_PRIOR_TRIALS` pseudo-trials of the engine's live estimate;
  - the router's estimate per prompt class (`router/observer.py`): decay per finished request.
Pure Python (no torch): the engine, the router and the simulator all import it.
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINE_DECAY = 0.02          # weight of one drafting sequence-step in the engine's estimate
ENGINE_PRIOR_TRIALS = 1 / ENGINE_DECAY   # the prior weighs as much as a full decayed history
SEQ_PRIOR_TRIALS = 4.0       # pseudo-trials of the engine's estimate behind a sequence's own
CLASS_DECAY = 0.05           # weight of one finished request in a prompt class's estimate
CLASS_PRIOR_TRIALS = 50.0    # pseudo-trials of the prior behind a prompt class's estimate
MIN_SAMPLE_TRIALS = 16       # draft tokens tried before a finished request's a is a sample


def posterior(accepted: float, trials: float, prior: float, prior_trials: float) -> float:
    """(accepted + prior_trials * prior) / (trials + prior_trials): counts behind a prior."""
    return (accepted + prior_trials * prior) / (trials + prior_trials)


@dataclass
class AcceptanceEstimate:
    """Decaying pooled counts: each observation first multiplies the old counts by (1 - decay).

    Starts at (prior * prior_trials, prior_trials). decay = 0 keeps every count.
    """

    prior: float
    prior_trials: float
    decay: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.prior <= 1.0 or self.prior_trials <= 0 or not 0.0 <= self.decay < 1.0:
            raise ValueError("prior in [0, 1], prior_trials > 0 and decay in [0, 1)")
        self.reset()

    def reset(self, prior: float | None = None) -> None:
        """Forget everything (a new draft serves): back to the prior (or a new one)."""
        if prior is not None:
            self.prior = prior
        self.accepted, self.trials = self.prior * self.prior_trials, float(self.prior_trials)

    def observe(self, accepted: float, trials: float) -> None:
        keep = 1.0 - self.decay
        self.accepted = keep * self.accepted + accepted
        self.trials = keep * self.trials + trials

    @property
    def value(self) -> float:
        return self.accepted / self.trials
