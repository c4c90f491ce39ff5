"""Price by what ran, in integer micro-dollars, and the usage block that shows it.

The rule (one, documented in the README and docs/decisions/0018-price-by-what-ran.md):
- the small tier: prompt and completion tokens at the small prices;
- the target (speculative and baseline modes of the same replicas): completion tokens the
  engine emitted while the sequence was in speculative mode at the speculative completion
  price, the rest at the baseline completion price; the prompt at the speculative prompt price
  if any token was produced speculating (the draft prefilled it too), else the baseline one.
Prices in the config are USD per million tokens, which is micro-dollars per token; the sum is
computed exactly (`Fraction`) and rounded half up to a whole micro-dollar per request, so a
ledger total equals the sum of the responses' `price_micro_usd` exactly.
Money lives here, in one representation: integer micro-dollars (`price_usd` in a response and
`usd_text` in reports are views of it). Owns this arithmetic and `BilledUsage` (the OpenAI
`usage` with specserve's fields). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from router.openai_schema import Usage


@dataclass(frozen=True)
class RunCounts:
    """What a request actually ran, from the last chunk a replica streamed (cumulative)."""
    tier: str                      # the router's choice: speculative | baseline | small
    prompt_tokens: int
    completion_tokens: int
    speculative_tokens: int = 0    # completion tokens emitted in speculative mode
    draft_tokens: int = 0
    accepted_tokens: int = 0


def _rate(prices, tier: str, part: str) -> Fraction:
    price = prices[tier]
    value = price.prompt_per_1m if part == "prompt" else price.completion_per_1m
    return Fraction(str(value))          # "0.1" -> 1/10 exactly (not the binary float)


def price_micro_usd(prices: dict, run: RunCounts) -> int:
    """Micro-dollars for one request (prices: tier -> object with *_per_1m)."""
    if run.tier == "small":
        exact = (run.prompt_tokens * _rate(prices, "small", "prompt")
                 + run.completion_tokens * _rate(prices, "small", "completion"))
    else:
        spec = min(run.speculative_tokens, run.completion_tokens)
        prompt_tier = "speculative" if spec > 0 else "baseline"
        exact = (run.prompt_tokens * _rate(prices, prompt_tier, "prompt")
                 + spec * _rate(prices, "speculative", "completion")
                 + (run.completion_tokens - spec) * _rate(prices, "baseline", "completion"))
    return int(exact + Fraction(1, 2))   # half up (exact >= 0)


def usd_text(micro_usd: int) -> str:
    """Micro-dollars as USD with six decimals, exactly (no binary float on the way)."""
    sign = "-" if micro_usd < 0 else ""
    whole, part = divmod(abs(micro_usd), 1_000_000)
    return f"{sign}{whole}.{part:06d}"


class BilledUsage(Usage):
    """OpenAI's usage plus what ran and what it cost (`price_usd` = micro-dollars / 1e6)."""
    price_micro_usd: int
    speculative_tokens: int             # completion tokens priced at the speculative price
    baseline_tokens: int                # completion tokens priced at the baseline (or small) price
    mode: str                           # the mode the request ended in
    speculation_dropped: bool           # admitted speculative, finished in baseline
    draft_tokens: int = 0
    accepted_tokens: int = 0


def billed_usage(prices: dict, run: RunCounts, reason: str, mode: str, dropped: bool,
                 acceptance_rate=None, mean_acceptance_length=None) -> BilledUsage:
    micro = price_micro_usd(prices, run)
    spec = 0 if run.tier == "small" else min(run.speculative_tokens, run.completion_tokens)
    return BilledUsage(
        prompt_tokens=run.prompt_tokens, completion_tokens=run.completion_tokens,
        total_tokens=run.prompt_tokens + run.completion_tokens, tier=run.tier, reason=reason,
        price_usd=micro / 1e6, price_micro_usd=micro, speculative_tokens=spec,
        baseline_tokens=run.completion_tokens - spec, mode=mode, speculation_dropped=dropped,
        draft_tokens=run.draft_tokens, accepted_tokens=run.accepted_tokens,
        acceptance_rate=acceptance_rate, mean_acceptance_length=mean_acceptance_length)
