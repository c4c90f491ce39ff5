"""Test-only fault injection, off by default: real exceptions raised inside a model's forward.

Enabled by `EngineConfig(fault_injection=True)` (a deployment sets it through the tier's
`engine_args`); never on in production configs. When enabled, the engine wraps its draft
and target runners in `FaultyRunner`, and `LLMEngine.inject_fault("draft_raise", n)` (or
`"target_raise"`) makes the next n forwards of that model raise `InjectedFault` from inside the
forward call, exactly where a real device error would surface. `"engine_crash"` raises at the
start of the next `LLMEngine.step`, outside its per-step isolation, so the async engine's loop
dies (a stand-in for a bug in the scheduler). `"rank_raise"` arms rank 1 of a tensor-parallel
target (`engine/tp_worker.py`): its next forward raises in the middle, between two layers'
all-reduces, as a device error on that GPU would.
The fault tests use them to check that speculation degrades to baseline and that a dead engine
fails its health check and stops receiving traffic.
"""

from __future__ import annotations

KINDS = ("draft_raise", "target_raise", "engine_crash", "rank_raise")


class InjectedFault(RuntimeError):
    """Raised by an armed fault (never outside tests)."""


class Faults:
    def __init__(self) -> None:
        self.pending = {kind: 0 for kind in KINDS}
        self.skip = {kind: 0 for kind in KINDS}

    def arm(self, kind: str, count: int = 1, after: int = 0) -> None:
        """The next `count` calls raise, once `after` more calls have passed (so a test can arm a
        fault before a request and have it land mid-stream, with no race against the engine)."""
        if kind not in self.pending:
            raise ValueError(f"unknown fault {kind!r}; known: {KINDS}")
        self.pending[kind] += count
        self.skip[kind] = after

    def fire(self, kind: str) -> None:
        if self.skip[kind] > 0:
            self.skip[kind] -= 1
            return
        if self.pending[kind] > 0:
            self.pending[kind] -= 1
            raise InjectedFault(f"injected fault: {kind}")


class Delays:
    """TEST ONLY: seconds of sleep added where a slow device would add them. "target": every
    target forward; "drafted_step": the end of every step that drafted, outside the parts the
    step times for its cost model (a cost the model does not see)."""

    def __init__(self) -> None:
        self.seconds = {"target": 0.0, "drafted_step": 0.0}

    def set(self, kind: str, seconds: float) -> None:
        if kind not in self.seconds:
            raise ValueError(f"unknown delay {kind!r}; known: {sorted(self.seconds)}")
        self.seconds[kind] = float(seconds)

    def sleep(self, kind: str) -> None:
        if self.seconds[kind] > 0:
            import time

            time.sleep(self.seconds[kind])


class FaultyRunner:
    """A ModelRunner whose `run` raises when its fault is armed; everything else passes through."""

    def __init__(self, runner, faults: Faults, kind: str, delays: Delays | None = None,
                 delay: str | None = None):
        self._runner, self._faults, self._kind = runner, faults, kind
        self._delays, self._delay = delays, delay

    def run(self, *args, **kwargs):
        self._faults.fire(self._kind)
        if self._delays is not None and self._delay:
            self._delays.sleep(self._delay)
        return self._runner.run(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._runner, name)
