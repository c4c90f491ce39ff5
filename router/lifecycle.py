"""How a request at the ingress ends: one place for every outcome, and the ingress's counters.

`RequestLife` is an async context manager around one request's handling. However the request
ends, it ends here, once, with one of three outcomes:
- ok: the engine finished it. `finish(last)` prices what ran and spools the ledger record
  (fsync) before the response's last bytes go out, then tells the observer.
- client_gone (HTTP status 499): the handler or its stream was cancelled or closed before the
  last chunk. What ran so far is priced and recorded.
- error: an `HTTPError` (refused, or a tier failure the ingress mapped) or a bug (logged with
  the request id, answered as a 500 in OpenAI's shape). The partial usage is recorded with the
  status and the message.
On every outcome the tier stream is cancelled (the replica aborts the sequence and frees its
KV), the admission ticket is released and `specserve_requests` counts the status; a priced
record also counts into the revenue counters.

A streamed response takes the end with it: `hand_off(response)` makes the handler's block exit
without ending the request, and the SSE generator's own `async with life` ends it. A stream
that is collected before it ran ends as client_gone.

Owns the end and `IngressMetrics`. Does not own prices (`router/billing.py`), the ledger
(`router/ledger.py`) nor the routes (`router/ingress.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref

from ray.serve import metrics

from router.billing import BilledUsage
from router.observer import RequestOutcome
from router.openai_schema import HTTPError

logger = logging.getLogger("ray.serve")


class IngressMetrics:
    """The ingress's Prometheus counters (Ray's metrics: exported on each node's metrics port)."""

    def __init__(self):
        self.decisions = metrics.Counter("specserve_tier_decisions", tag_keys=("tier", "reason"),
                                         description="Tier decisions by tier and reason.")
        self.requests = metrics.Counter("specserve_requests", tag_keys=("status", "tier", "api"),
                                        description="Finished HTTP requests by status code.")
        self.price = metrics.Counter("specserve_price_usd", tag_keys=("tier",),
                                     description="USD charged, by the router's tier.")
        self.billed = metrics.Counter("specserve_billed_tokens", tag_keys=("tier",),
                                      description="Completion tokens billed, by the price "
                                                  "they were billed at (what ran).")
        self.completion = metrics.Counter("specserve_completion_tokens", tag_keys=("tier",),
                                          description="Completion tokens, by the router's tier.")

    def decided(self, tier: str, reason: str) -> None:
        self.decisions.inc(tags={"tier": tier, "reason": reason})

    def ended(self, http_status: int, tier: str, api: str) -> None:
        self.requests.inc(tags={"status": str(http_status), "tier": tier, "api": api})

    def charged(self, usage: BilledUsage) -> None:
        """One ledger record's money and tokens (counted once per request, as the ledger)."""
        if usage.price_micro_usd > 0:
            self.price.inc(usage.price_usd, tags={"tier": usage.tier})
        if usage.completion_tokens:
            self.completion.inc(usage.completion_tokens, tags={"tier": usage.tier})
        for tier, n in ((("small", usage.baseline_tokens),) if usage.tier == "small" else
                        (("speculative", usage.speculative_tokens),
                         ("baseline", usage.baseline_tokens))):
            if n:
                self.billed.inc(n, tags={"tier": tier})


class RequestLife:
    """One request at the ingress, from admission to its one end (see the module docstring).

    The handler fills in what the request acquires as it goes: `ticket` (admission), `tier`,
    `prompt_class`, `charge` (admitted for billing: from then on the request has a ledger
    record), `stream` (the tier's response stream) and `last` (the latest cumulative chunk).
    """

    def __init__(self, accounts, metrics: IngressMetrics, observer, api: str, request_id: str):
        self.accounts = accounts        # router.accounting.Accounting: prices and the ledger
        self.metrics = metrics
        self.observer = observer        # router.observer.Observer: learns from finished requests
        self.api = api                  # completions | chat
        self.request_id = request_id
        self.ticket = None
        self.tier = "none"
        self.prompt_class = ""
        self.charge = None
        self.stream = None
        self.last = None
        self.usage: BilledUsage | None = None     # set by finish(): the request ended ok
        self.error: HTTPError | None = None       # set when the request ends in an error
        self.response = None                      # the error response, once __aexit__ made it
        self._handed_off = False
        self._ended = False

    async def __aenter__(self) -> "RequestLife":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        if exc is None and self._handed_off:
            self._handed_off = False        # the stream's own `async with` ends the request
            return False
        if exc is None:
            if self.usage is not None:
                self._end("ok", 200)
            elif self.error is not None:
                self._end("error", self.error.status, self.error.message)
            else:                           # the stream closed before its last chunk
                self._end("client_gone", 499)
            return False
        if not isinstance(exc, Exception):  # cancelled or closed: the client went away
            self._end("client_gone", 499)
            return False
        if not isinstance(exc, HTTPError):
            logger.error("request %s failed", self.request_id, exc_info=exc)
            exc = HTTPError(500, f"internal error (request {self.request_id})", "internal_error")
        self.error = exc
        self.response = exc.response()
        self._end("error", exc.status, exc.message)
        return True                         # answered: the handler returns `self.response`

    def hand_off(self, response):
        """The streamed response's generator ends the request (it runs `async with self`)."""
        self._handed_off = True
        weakref.finalize(response.body_iterator, self._end, "client_gone", 499)
        return response

    async def finish(self, last) -> BilledUsage:
        """The engine finished the request: price it, spool its record (fsync), tell the
        observer. Returns the usage the response carries."""
        self.last = last
        self.usage = await asyncio.to_thread(self._record, "ok", 200)
        now = time.time()
        self.observer.finished(self.tier, self.prompt_class, RequestOutcome(
            last.num_prompt_tokens, last.num_output_tokens, last.num_accepted_tokens,
            last.num_draft_trials, last.draft, now - self.charge.started_at, now))
        return self.usage

    def _record(self, status: str, http_status: int, error: str | None = None) -> BilledUsage:
        """Price what ran so far and write the ledger record; the first record of a request
        wins (a cancel may race the normal end) and only that one counts as revenue."""
        usage = self.accounts.usage(self.charge, self.last)
        if self.accounts.record(self.charge, usage, status, http_status, error):
            self.metrics.charged(usage)
        return usage

    def _end(self, status: str, http_status: int, error: str | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        if self.stream is not None:
            self.stream.cancel()        # no-op when exhausted; else the replica aborts it
        if self.ticket is not None:
            self.ticket.release()
        if self.charge is not None and not self.charge.done:
            self._record(status, http_status, error)
        self.metrics.ended(http_status, self.tier, self.api)
