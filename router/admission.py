"""The ingress's own admission limit and drain switch.

Serve's proxy answers in plain text when a deployment's queue is full, so the ingress keeps
its own bound below its `max_ongoing_requests`: past `max_in_flight` it answers 429 with
Retry-After in OpenAI's shape itself, and the proxy never has to. `drain()` (called by
`specserve up` on SIGTERM/SIGINT) stops admitting: new requests get 503 with Retry-After
while the ones in flight run to their end. A ticket is released exactly once, when the
response (its whole stream) is over; a stream that is dropped before it starts releases its
ticket when it is garbage-collected. Pure Python, no Ray.
"""

from __future__ import annotations

import weakref

from router.openai_schema import HTTPError


class Ticket:
    def __init__(self, admission: "Admission"):
        self._admission: Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:
            self._admission.in_flight -= 1
            self._admission = None

    def release_with(self, obj) -> None:
        """Release also when `obj` (a response's stream) is collected without running."""
        weakref.finalize(obj, self.release)


class Admission:
    def __init__(self, max_in_flight: int, retry_after: str):
        self.max_in_flight = max_in_flight
        self.retry_after = retry_after
        self.in_flight = 0
        self.draining = False

    def enter(self) -> Ticket:
        headers = {"Retry-After": self.retry_after}
        if self.draining:
            raise HTTPError(503, "the server is shutting down; retry on another instance or "
                            "later", "shutting_down", headers=headers)
        if self.in_flight >= self.max_in_flight:
            raise HTTPError(429, f"the server has {self.in_flight} requests in flight, its "
                            "limit; retry later", "overloaded", headers=headers)
        self.in_flight += 1
        return Ticket(self)
