"""Drafting judged by what it delivers: short windows with drafting capped and uncapped, compared.

The k rule (`engine/k_rule.py`) drafts where its step-cost model predicts a gain. A model can
be wrong where it matters: a draft slower than its profile, traffic whose acceptance differs
from what the profile saw, costs the profile never timed. `GoodputCheck` measures instead: on
the live batch it alternates windows of `window_steps` steps with drafting capped (k = 0 for
every sequence) and uncapped (the k rule's choice), and compares the tokens a second each
delivered (each step's whole wall time, so every cost of a drafting step counts, those the
cost model's timed parts leave out too). Drafting stays on only where the uncapped windows
delivered at least `1 + margin` times the capped ones (`1 + batch_margin` for a batch: the k
rule's own margins, `engine/k_rule.py`), over the last `pairs` pairs of adjacent windows
(adjacent windows see nearly the same batch). Plain decoding wins every tie: the promise is
never to be slower.

Verdicts are kept per regime: the engine's live per-token acceptance in bins of
`regime_width`, and the batch's size in powers of two (drafting that pays for 2 sequences can
lose for 32, where verification is no longer free). A traffic shift or a change of load moves
the engine to another regime, judged afresh within `pairs` pairs of windows, seconds at
serving speeds. Once judged, a regime is checked again
with one pair every `recheck_steps` steps; where drafting pays, that pair's capped window is
what the check costs (`window_steps / recheck_steps` of the steps, at below drafting's speed:
under 1% with the defaults). A recheck that disagrees with the verdict starts the regime's
judgement afresh, so a change (a draft that slowed down) is followed within `pairs` pairs.

Every step in which a sequence may draft counts, whatever the k rule then chose: the windows
compare the k rule's choices against no drafting on the same kind of steps, since the steps in
which the rule wants to draft are not a fair sample (docs/decisions/0024-goodput-check.md). The
engine asks before it computes the k rule, so a capped window costs nothing of it. Pure
Python: no torch, no clock of its own (the engine passes the times).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.k_rule import MIN_GAIN, MIN_GAIN_ALONE


@dataclass
class _Window:
    capped: bool
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Regime:
    ratios: list[float] = field(default_factory=list)   # log(uncapped / capped) of past pairs
    window: _Window | None = None                       # the window under way
    last: _Window | None = None                         # the window before it, in this pair
    pays: bool | None = None                            # None: not judged yet
    since_check: int = 0                                # judged steps since the last pair


@dataclass
class GoodputCheck:
    window_steps: int = 16
    pairs: int = 3
    margin: float = MIN_GAIN_ALONE      # a sequence alone (the router's own margin) ...
    batch_margin: float = MIN_GAIN      # ... and a batch: the k rule's margins, for its reasons
    recheck_steps: int = 2048
    regime_width: float = 0.1
    regimes: dict[tuple[int, int], _Regime] = field(default_factory=dict)
    current: tuple[int, int] | None = None

    def regime_of(self, acceptance: float, batch: int = 1) -> tuple[int, int]:
        """(acceptance bin, batch bin): batches of 1, 2-3, 4-7, 8-15, ... share a bin."""
        return (min(int(acceptance / self.regime_width), int(1 / self.regime_width) - 1),
                max(1, batch).bit_length())

    def allow(self, acceptance: float, batch: int = 1) -> bool:
        """Whether the next step may draft (the k rule wanting to), at this acceptance, for a
        batch of `batch` decoding sequences."""
        key = self.regime_of(acceptance, batch)
        self.current = key
        r = self.regimes.setdefault(key, _Regime())
        if r.window is None:
            r.window = self._next_window(r)
        return not r.window.capped

    def observe(self, tokens: int, seconds: float) -> None:
        """The step that `allow` was asked for ran: it emitted `tokens` in `seconds`."""
        r = self.regimes.get(self.current) if self.current is not None else None
        if r is None or r.window is None:
            return
        w = r.window
        w.steps, w.tokens, w.seconds = w.steps + 1, w.tokens + tokens, w.seconds + seconds
        if w.steps < self.window_steps:
            return
        r.window = None
        if r.last is None or r.last.capped == w.capped:
            r.last = w if self._exploring(r) else None
            return
        capped, uncapped = (r.last, w) if r.last.capped else (w, r.last)
        r.last = None
        if capped.rate <= 0 or uncapped.rate <= 0:
            return
        x = math.log(uncapped.rate / capped.rate)
        bar = math.log(1 + (self.margin if self.current[1] == 1 else self.batch_margin))
        if r.pays is not None and (x >= bar) != r.pays:
            r.ratios, r.pays = [x], None   # a recheck disagrees: judge afresh from this pair
        else:
            r.ratios = (r.ratios + [x])[-self.pairs:]
        if len(r.ratios) >= self.pairs:
            mean = sum(r.ratios) / len(r.ratios)
            r.pays = mean >= bar
            r.since_check = 0

    def verdict(self, acceptance: float, batch: int = 1) -> bool | None:
        """Drafting pays at this acceptance and batch (True), loses (False), or is not judged
        (None)."""
        r = self.regimes.get(self.regime_of(acceptance, batch))
        return None if r is None else r.pays

    def _exploring(self, r: _Regime) -> bool:
        return r.pays is None or r.since_check >= self.recheck_steps

    def _next_window(self, r: _Regime) -> _Window:
        """A judged regime runs its verdict, and one pair every `recheck_steps` steps; one not
        judged alternates capped and uncapped windows, starting uncapped."""
        if r.last is not None:                      # finish the pair under way
            return _Window(capped=not r.last.capped)
        if not self._exploring(r):
            r.since_check += self.window_steps
            return _Window(capped=not r.pays)
        # a pair's first window: the verdict's opposite first, so a recheck measures the
        # alternative while the batch still matches the verdict's last windows
        return _Window(capped=bool(r.pays))
