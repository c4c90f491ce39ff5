"""Counters a server exports, named after vLLM's spec-decode metrics where one exists.

acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

KV_PEAK_WINDOW_S = 2.0  # EngineStats' KV peaks: the most in use at any step of this many seconds


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


@dataclass
class ServingTimes:
    """Where a served engine's time goes, cumulative since it started (`EngineStats.serving`;
    `bench serve` takes each window's differences from `/health`, and `specserve simulate
    --scenario local-cpu` times its engines with them):
      - steps: every step's seconds, its draft rounds' part, and what the engine's profiled
        cost prices the same steps at (`engine.step_cost.step_parts`), so that a window's
        steps took (step_s - draft_s) / priced_target_s and draft_s / priced_draft_s of their
        profile's prices, over all its steps (prompt chunks and drafts catching up included)
        rather than the calibration's last reading;
      - gaps: the time between two steps while requests waited for the next one, what the loop
        around `LLMEngine.step` (the engine process's messages and inbox, or the replica's
        thread) and whatever else ran on the core took (a step after an idle spell starts
        none: that wait is the callers');
      - requests: finished requests and their seconds in the engine (add_request to the final
        output), so that what a caller waited beyond it is the serving path's (HTTP, router,
        Ray)."""

    steps: int = 0
    step_s: float = 0.0
    draft_s: float = 0.0
    priced_target_s: float = 0.0
    priced_draft_s: float = 0.0
    gaps: int = 0
    gap_s: float = 0.0
    requests: int = 0
    request_s: float = 0.0
    _ended: float | None = field(default=None, repr=False, compare=False)   # the last step's end,
    #   if work was left then

    def begin(self, now: float) -> None:
        if self._ended is not None:
            self.gaps += 1
            self.gap_s += max(0.0, now - self._ended)

    def end(self, now: float, work_left: bool) -> None:
        self._ended = now if work_left else None

    def stepped(self, seconds: float, draft_s: float, priced: tuple[float, float]) -> None:
        self.steps += 1
        self.step_s += seconds
        self.draft_s += draft_s
        self.priced_draft_s += priced[0]
        self.priced_target_s += priced[1]

    def finished(self, seconds: float) -> None:
        self.requests += 1
        self.request_s += seconds


class KVPeaks:
    """The most KV blocks in use at any step of the last KV_PEAK_WINDOW_S, per kind, so a
    report shows the peak between two reports and not only the moment it is taken."""

    def __init__(self) -> None:
        self._marks: deque[tuple[float, int, int]] = deque()   # (time, target, draft blocks)

    def mark(self, used: dict[str, int]) -> None:
        """Remember this step's blocks in use (held from here to the step's end)."""
        now = time.monotonic()
        self._marks.append((now, used["target"], used["draft"]))
        while self._marks[0][0] < now - KV_PEAK_WINDOW_S:
            self._marks.popleft()

    def peaks(self, used: dict[str, int], block_bytes: int) -> tuple[int, int]:
        """(target, draft) peak bytes over the window, what is in use now included."""
        since = time.monotonic() - KV_PEAK_WINDOW_S
        recent = [m for m in self._marks if m[0] >= since]
        return (max([used["target"]] + [m[1] for m in recent]) * block_bytes,
                max([used["draft"]] + [m[2] for m in recent]) * block_bytes)
