"""Revenue: a finished request's usage priced and spooled to the ledger, and counted in metrics.

Pricing only (`router/accounting.py` prices what ran and writes the ledger record); what the
request tells the policy goes to `router/observer.py`, separately, from the ingress.
"""

from __future__ import annotations

from ray.serve import metrics


class Revenue:
    def __init__(self, accounts):
        self.accounts = accounts
        self.m_price = metrics.Counter("specserve_price_usd", tag_keys=("tier",),
                                       description="USD charged, by the router's tier.")
        self.m_billed = metrics.Counter("specserve_billed_tokens", tag_keys=("tier",),
                                        description="Completion tokens billed, by the price "
                                                    "they were billed at (what ran).")
        self.m_completion = metrics.Counter("specserve_completion_tokens", tag_keys=("tier",),
                                            description="Completion tokens, by the router's tier.")

    async def finish(self, charge, last):
        """A request that finished normally: price what ran, spool the record (fsync)."""
        usage = await self.accounts.finish_async(charge, last, "ok", 200)
        self.count(usage)
        return usage

    def end(self, charge, last, status: str, http_status: int, error: str | None = None) -> None:
        """A request that did not finish normally: its partial usage goes to the ledger."""
        if charge is not None and not charge.done:
            self.count(self.accounts.finish(charge, last, status, http_status, error))

    def count(self, usage) -> None:
        if usage.price_micro_usd > 0:
            self.m_price.inc(usage.price_usd, tags={"tier": usage.tier})
        if usage.completion_tokens:
            self.m_completion.inc(usage.completion_tokens, tags={"tier": usage.tier})
        for tier, n in ((("small", usage.baseline_tokens),) if usage.tier == "small" else
                        (("speculative", usage.speculative_tokens),
                         ("baseline", usage.baseline_tokens))):
            if n:
                self.m_billed.inc(n, tags={"tier": tier})
