"""What the ingress asks about money: who is calling, may they, what did it cost, write it down.

`Accounting` wires the database (`router/store.py`), the live keys (`router/keys.py`), the
rate limiter (`router/ratelimit.py`), the price rule (`router/billing.py`) and the ledger
(`router/ledger.py`) from one `AppConfig`, so the ingress needs only a few hooks:
`admit` after the tier decision (429 with headers when over a limit), then `usage` and
`record` when the request ends however it ends (ok, client gone, error: the usage seen so far
is priced and spooled before the response completes; `router/lifecycle.py` calls them).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from router.billing import BilledUsage, RunCounts, billed_usage
from router.keys import KeyRecord, KeyStore, KeyTable
from router.ledger import Ledger, LedgerRecord
from router.openai_schema import HTTPError
from router.policy import PROBES
from router.ratelimit import RateLimiter
from router.store import Database, default_url


_FINISH_LOCK = threading.Lock()


@dataclass
class Charge:
    """One admitted request: everything its ledger record needs besides the usage."""
    request_id: str
    key_id: str
    key_name: str
    plan: str
    endpoint: str
    api: str
    tier: str
    reason: str
    requested_mode: str
    reserved_tokens: int | None
    started_at: float
    headers: dict = field(default_factory=dict)   # x-ratelimit-* for the response
    done: bool = False


def ledger_location(ledger_cfg) -> tuple[str, Path]:
    url = ledger_cfg.url or default_url()
    if ledger_cfg.spool_dir:
        spool = Path(ledger_cfg.spool_dir)
    elif url.startswith("sqlite:///"):
        spool = Path(url[len("sqlite:///"):]).expanduser().with_suffix(".spool")
    else:
        spool = Path("~/.specserve/spool").expanduser()
    return url, spool


class Accounting:
    def __init__(self, cfg, start: bool = True):
        url, spool = ledger_location(cfg.ledger)
        self.db = Database(url)
        self.prices = cfg.prices
        self.key_table = KeyTable(self.db)
        self.keys = KeyStore.from_config(cfg.auth, self.key_table)
        self.limiter = RateLimiter(Database(url, durable=False), cfg.plans)
        self.ledger = Ledger(self.db, spool, cfg.ledger.drain_period_s,
                             on_insert=RateLimiter.settle)
        if start:
            self.keys.start()
            self.ledger.start()

    # -- admission ----------------------------------------------------------------------------
    async def admit(self, request_id: str, key: KeyRecord | None, plan: str, endpoint: str,
                    api: str, tier: str, reason: str, tokens: int) -> Charge:
        """Count the request against its key's limits (those of the key's own plan, whatever
        endpoint it calls); raises a 429 `HTTPError` when over."""
        now = time.time()
        key_id = key.id if key is not None else "anonymous"
        reserved, headers = None, {}
        limit_plan = key.plan if key is not None else plan   # the subscription's limits
        if self.limiter.limited(limit_plan):
            admission = await asyncio.to_thread(self.limiter.admit, key_id, limit_plan, tokens,
                                                now)
            if not admission.allowed:
                raise HTTPError(429, admission.message, admission.code, headers=admission.headers)
            reserved, headers = admission.reserved_tokens, admission.headers
        return Charge(request_id, key_id, key.name if key is not None else "anonymous", plan,
                      endpoint, api, tier, reason,
                      "speculative" if tier == "speculative" else "baseline", reserved, now,
                      headers)

    # -- the end of a request -----------------------------------------------------------------
    def usage(self, charge: Charge, last) -> BilledUsage:
        """The priced usage of what ran so far (`last`: the latest cumulative chunk or None)."""
        # Economy pays the small tier's price wherever it ran (the policy sends it to baseline
        # only while the small tier is down): an outage never costs the caller more.
        # A probe (router/policy.py: PROBES) speculates to measure for the cluster where auto
        # would have run it at baseline: the caller pays baseline.
        priced = "small" if charge.plan == "economy" else charge.tier
        probe = charge.reason in PROBES
        run = RunCounts(priced, getattr(last, "num_prompt_tokens", 0),
                        getattr(last, "num_output_tokens", 0),
                        0 if probe else getattr(last, "num_speculative_tokens", 0),
                        getattr(last, "num_draft_tokens", 0),
                        getattr(last, "num_accepted_tokens", 0))
        mode = getattr(last, "mode", None) or charge.requested_mode
        if charge.tier == "small":
            mode = "baseline"
        dropped = charge.requested_mode == "speculative" and mode != "speculative"
        reason = getattr(last, "reason", None) or charge.reason   # the engine may change it
        usage = billed_usage(self.prices, run, reason, mode, dropped,
                             getattr(last, "acceptance_rate", None),
                             getattr(last, "mean_acceptance_length", None))
        return usage if priced == charge.tier else usage.model_copy(update={"tier": charge.tier})

    def record(self, charge: Charge, usage: BilledUsage, status: str, http_status: int,
               error: str | None = None) -> bool:
        """Spool the request's ledger record (blocking fsync). Only the first call for a
        request writes (a cancel may race a normal end); returns whether this one did."""
        with _FINISH_LOCK:
            if charge.done:
                return False
            charge.done = True
        self.ledger.record(LedgerRecord(
            request_id=charge.request_id, key_id=charge.key_id, key_name=charge.key_name,
            plan=charge.plan, endpoint=charge.endpoint, api=charge.api, tier=charge.tier,
            reason=usage.reason, mode=usage.mode, speculation_dropped=usage.speculation_dropped,
            status=status, http_status=http_status, prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens, speculative_tokens=usage.speculative_tokens,
            draft_tokens=usage.draft_tokens, accepted_tokens=usage.accepted_tokens,
            price_micro_usd=usage.price_micro_usd, reserved_tokens=charge.reserved_tokens,
            started_at=charge.started_at, finished_at=time.time(), error=error))
        return True

    def close(self) -> None:
        self.ledger.stop()
