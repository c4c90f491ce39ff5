"""The closed alignment loop's decisions: when to distil, and whether a canary draft is promoted
or rolled back. Pure functions of what the observer measured; no clock, I/O, torch or Ray.

The loop (issue 46's deployment) calls them with per-class live figures (`ClassLive`: the
acceptance rate accepted / drafted and goodput, output tokens a second of speculative
requests, over a window of requests) and acts on the `Decision`. Rules, in order:

  when                           | a rule                                         | action / reason
  -------------------------------|------------------------------------------------|------------------------------
  trigger: a round is running    | one round at a time                            | wait     round_running
  trigger: per class             | acceptance < threshold over >= min_requests    |
                                 | since >= stay_below_s, with >= min_prompts     |
                                 | captured prompts of the class                  | distil   class_below_threshold
                                 | below, but too few captured prompts            | wait     too_few_prompts
                                 | below, not yet for stay_below_s                | wait     not_below_long_enough
  trigger: otherwise             |                                                | wait     every_class_aligned
  canary: each class needs >= canary_requests on the canary and on the rest, else wait (canary_too_short)
  canary: a class loses          | canary acceptance < rest - loss_tolerance, or  |
                                 | goodput < rest x (1 - loss_tolerance)          | rollback class_lost
  canary: no gain                | request-weighted acceptance gain < margin      | rollback no_gain
  canary: otherwise              |                                                | promote  canary_won
  promoted: a class drops        | acceptance < promoted figure - rollback_drop   | rollback dropped_after_promotion
  promoted: otherwise            |                                                | keep     holding

The lowest class picked first: when several classes qualify, the one with the lowest live
acceptance is distilled (its gain decides most). A class with fewer requests than the window
asks is not judged: acceptance over a handful of requests is noise.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIONS = ("wait", "distil", "promote", "rollback", "keep")


@dataclass(frozen=True)
class AlignmentConfig:
    """The loop's rules: `alignment.rules` in the app config (router/alignment_config.py)."""

    threshold: float = 0.55        # a class's live acceptance below this asks for a round
    min_requests: int = 200        # speculative requests of a class before its figure counts
    stay_below_s: float = 600.0    # how long it must stay below (a dip is not a drift)
    min_prompts: int = 500         # captured prompts of the class a round needs
    canary_requests: int = 300     # per class, on the canary and on the rest, before judging
    margin: float = 0.02           # the canary's request-weighted acceptance gain to promote
    loss_tolerance: float = 0.01   # no class may lose more than this (acceptance; goodput share)
    rollback_drop: float = 0.05    # a promoted draft's drop below its canary figure rolls back

    def __post_init__(self) -> None:
        for name in ("threshold", "margin", "loss_tolerance", "rollback_drop"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"alignment.{name} must be a number in [0, 1], got {value!r}")
        for name in ("min_requests", "min_prompts", "canary_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"alignment.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.stay_below_s, (int, float)) or self.stay_below_s < 0:
            raise ValueError(f"alignment.stay_below_s must be >= 0, got {self.stay_below_s!r}")


@dataclass(frozen=True)
class ClassLive:
    """One prompt class's live figures over the observer's window."""

    acceptance: float              # accepted / drafted
    requests: int                  # speculative requests the figures cover
    goodput: float | None = None   # output tokens a second of its speculative requests
    below_since: float | None = None   # seconds it has been below the threshold (None: not below)


@dataclass(frozen=True)
class Decision:
    action: str                    # one of ACTIONS
    reason: str
    prompt_class: str | None = None

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}")


def trigger(cfg: AlignmentConfig, live: dict[str, ClassLive], captured: dict[str, int],
            round_running: bool) -> Decision:
    """Whether to start a distillation round now, and on which class."""
    if round_running:
        return Decision("wait", "round_running")
    below = sorted(((c.acceptance, name) for name, c in live.items()
                    if c.requests >= cfg.min_requests and c.acceptance < cfg.threshold))
    waiting: Decision | None = None
    for _, name in below:
        c = live[name]
        if c.below_since is None or c.below_since < cfg.stay_below_s:
            waiting = waiting or Decision("wait", "not_below_long_enough", name)
        elif captured.get(name, 0) < cfg.min_prompts:
            waiting = waiting or Decision("wait", "too_few_prompts", name)
        else:
            return Decision("distil", "class_below_threshold", name)
    return waiting or Decision("wait", "every_class_aligned")


def judge_canary(cfg: AlignmentConfig, canary: dict[str, ClassLive],
                 rest: dict[str, ClassLive]) -> Decision:
    """Promote the canary draft, roll it back, or wait for more requests."""
    classes = sorted(set(canary) | set(rest))
    for name in classes:
        if (canary.get(name) is None or rest.get(name) is None
                or canary[name].requests < cfg.canary_requests
                or rest[name].requests < cfg.canary_requests):
            return Decision("wait", "canary_too_short", name)
    for name in classes:
        new, old = canary[name], rest[name]
        lost_goodput = (new.goodput is not None and old.goodput is not None
                        and new.goodput < old.goodput * (1.0 - cfg.loss_tolerance))
        if new.acceptance < old.acceptance - cfg.loss_tolerance or lost_goodput:
            return Decision("rollback", "class_lost", name)
    weights = {name: canary[name].requests for name in classes}
    total = sum(weights.values())
    gain = sum(weights[n] * (canary[n].acceptance - rest[n].acceptance) for n in classes) / total
    if gain < cfg.margin:
        return Decision("rollback", "no_gain")
    return Decision("promote", "canary_won")


def watch_promoted(cfg: AlignmentConfig, promoted_at: dict[str, float],
                   live: dict[str, ClassLive]) -> Decision:
    """After promotion: roll back when a class's live acceptance drops below what the canary
    showed for it by more than `rollback_drop` (over a full window of requests)."""
    for name, figure in sorted(promoted_at.items()):
        c = live.get(name)
        if c is not None and c.requests >= cfg.min_requests and \
                c.acceptance < figure - cfg.rollback_drop:
            return Decision("rollback", "dropped_after_promotion", name)
    return Decision("keep", "holding")
