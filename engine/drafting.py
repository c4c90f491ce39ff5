"""Each step's drafting decision in an engine with adaptive k (`LLMEngine`): the goodput
check's window first (`engine/goodput.py`), then, only where drafting is not capped, the k rule
and its probe (`engine/k_rule.py`). Pure Python."""

from __future__ import annotations

from typing import Sequence

from engine.goodput import GoodputCheck
from engine.k_rule import DraftProbe, catch_up_prices, engine_choose_k
from engine.step_cost import StepCostModel


class StepDrafting:
    def __init__(self):
        self.goodput = GoodputCheck()   # drafting judged by what it delivers
        self.probe = DraftProbe()       # drafts now and then when no one has for a while
        self.judged = False             # this step is in the check's windows
        self.probe_only = False         # a capped step in which the k rule's probe is due

    def may_draft(self, acceptance: float, batch: int) -> bool:
        """Asked before the k rule in every step in which a sequence may draft, at the engine's
        live acceptance and the decoding batch's size. Every such step is in the check's
        windows, and in a capped one neither the k rule nor its inputs are computed: at a large
        batch they cost a few percent of the step (docs/decisions/0024-goodput-check.md). The
        k rule's probe still runs when due (what the rule knows of drafting moves only with
        drafting steps); its steps stay out of the windows."""
        self.probe_only = False
        if self.goodput.allow(acceptance, batch):
            self.judged = True
            return True
        self.probe_only = self.probe.due()
        self.judged = not self.probe_only
        if not self.probe_only:
            self.probe.tick()
        return self.probe_only

    def choose_k(self, cost: StepCostModel, acceptance: Sequence[float], k_max: Sequence[int],
                 context_tokens: int, extra_tokens: int,
                 catch_up_tokens: Sequence[int] | None = None,
                 tokens_left: Sequence[int] | None = None) -> list[int]:
        """k per sequence where `may_draft` allowed it: the probe's token alone in a probe's
        step, else the engine's k rule (which the simulator's engines share) and its probe."""
        if self.probe_only:
            return self.probe([0] * len(k_max), k_max, catch_up_tokens)
        catch_up = (catch_up_prices(cost, acceptance, catch_up_tokens, tokens_left,
                                    context_tokens) if catch_up_tokens else None)
        ks = engine_choose_k(acceptance, k_max, cost, context_tokens, extra_tokens, catch_up)
        return self.probe(ks, k_max, catch_up_tokens)

    def begin_step(self) -> None:
        self.judged = False

    def end_step(self, tokens: int, seconds: float) -> None:
        """The step ran: it emitted `tokens` in `seconds` of wall time."""
        if self.judged:
            self.goodput.observe(tokens, seconds)
