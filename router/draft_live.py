"""Live acceptance and goodput per draft and prompt class, from finished requests.

The alignment loop (deployments/alignment_loop.py) compares drafts on live traffic: the draft
that serves now, and a candidate that serves in alternating windows (its canary). Every
speculative request that drafted reports, on its last chunk, the draft it ran with
(`GenerateChunk.draft`; None when the draft was swapped while it ran: such a request belongs to
neither). `DraftWindows` keeps the last requests of each (draft, class) with their finish times,
so the loop can ask for the figures since a moment (a canary's start) as
`router.alignment.ClassLive`. Pure Python: no torch, no Ray.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from router.alignment import ClassLive

WINDOW_REQUESTS = 4096        # requests kept per (draft, class)


@dataclass(frozen=True)
class DraftSample:
    time: float               # when the request finished
    accepted: int             # draft tokens accepted
    trials: int               # draft tokens tried (accepted + rejections)
    tokens: int               # output tokens
    seconds: float            # from admission to the last token


class DraftWindows:
    def __init__(self, maxlen: int = WINDOW_REQUESTS):
        self.maxlen = maxlen
        self.samples: dict[tuple[str, str], deque[DraftSample]] = {}

    def add(self, draft: str, prompt_class: str, sample: DraftSample) -> None:
        if sample.trials <= 0:
            return
        key = (draft, prompt_class)
        self.samples.setdefault(key, deque(maxlen=self.maxlen)).append(sample)

    def view(self, since: float = 0.0, last: int | None = None) -> dict[str, dict[str, ClassLive]]:
        """draft -> class -> figures over its requests finished at or after `since` (at most
        the `last` of them): acceptance = accepted / tried, goodput = output tokens a second."""
        out: dict[str, dict[str, ClassLive]] = {}
        for (draft, name), window in self.samples.items():
            picked = [s for s in window if s.time >= since]
            if last is not None:
                picked = picked[-last:]
            trials = sum(s.trials for s in picked)
            if not trials:
                continue
            seconds = sum(s.seconds for s in picked)
            out.setdefault(draft, {})[name] = ClassLive(
                acceptance=sum(s.accepted for s in picked) / trials, requests=len(picked),
                goodput=sum(s.tokens for s in picked) / seconds if seconds > 0 else None)
        return out

    def as_dict(self, since: float = 0.0, last: int | None = None) -> dict:
        """`view` as plain data (for a handle call)."""
        return {draft: {name: {"acceptance": c.acceptance, "requests": c.requests,
                               "goodput": c.goodput} for name, c in classes.items()}
                for draft, classes in self.view(since, last).items()}


def from_dict(data: dict) -> dict[str, dict[str, ClassLive]]:
    return {draft: {name: ClassLive(**c) for name, c in classes.items()}
            for draft, classes in data.items()}
