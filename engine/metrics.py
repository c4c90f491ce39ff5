"""Counters a server exports, named after vLLM's spec-decode metrics where one exists.

acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MetricsSnapshot:
    num_drafts: int = 0                  # (sequence, step) pairs that drafted (k > 0)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_emitted_tokens: int = 0          # all tokens produced by steps (accepted + recovered/bonus)
    num_steps: int = 0
    num_preemptions: int = 0
    num_spec_downgrades: int = 0
    num_failed_steps: int = 0            # steps (or results) whose requests ended with an error
    num_draft_failures: int = 0          # steps where the draft raised; its sequences went baseline

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


class Metrics:
    def __init__(self) -> None:
        self.data = MetricsSnapshot()

    def record(self, k: int, accepted: int, emitted: int) -> None:
        d = self.data
        d.num_emitted_tokens += emitted
        if not k:
            return
        d.num_drafts += 1
        d.num_draft_tokens += k
        d.num_accepted_tokens += accepted
        if len(d.num_accepted_tokens_per_pos) < k:
            d.num_accepted_tokens_per_pos += [0] * (k - len(d.num_accepted_tokens_per_pos))
        for pos in range(accepted):
            d.num_accepted_tokens_per_pos[pos] += 1

    def snapshot(self, num_preemptions: int, num_spec_downgrades: int) -> MetricsSnapshot:
        d = self.data
        return MetricsSnapshot(d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens,
                               list(d.num_accepted_tokens_per_pos), d.num_emitted_tokens,
                               d.num_steps, num_preemptions, num_spec_downgrades,
                               d.num_failed_steps, d.num_draft_failures)
