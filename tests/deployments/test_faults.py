"""Faults on the real local cluster: requests in flight end clearly, service resumes.

The target is TP = 2 with a draft whose KV shape differs from the target's (the production
layout), next to a small tier. Three real faults, each mid-stream:
- the draft raises inside its forward (the test-only hook `fault_injection`, engine/faults.py):
  the request goes on on the target in baseline mode and says `draft_unavailable`;
- the small tier's replica process is killed: its stream ends with an error event;
- a TP rank of the target is killed: the replica leaves, its stream ends with an error event.
After each, new requests succeed within 30 s and no KV stays in use.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from serving_helpers import MODEL, served_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# A replacement replica must serve within this: a dead rank fails the health check (every 5 s),
# then Serve starts a new replica, whose ranks spawn and load the models. On a 2-core machine
# in a slow phase that can take a little over 30 s.
RECOVERY_S = 60.0
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def app(tiny_family, odd_draft, module_tmp):
    family = {**tiny_family, "draft": odd_draft}
    with served_app(module_tmp, family,
                    target={"tp_size": 2, "num_cpus_per_rank": 0.5,
                            "engine_args": {"adaptive_k": False, "fault_injection": True}}) as served:
        yield served


def _stream(app, plan: str, on_first=None, max_tokens: int = 300, **extra) -> list:
    """Stream a completion; call `on_first()` after the first content event. Returns events."""
    events = []
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True, **extra}
    with app.client(plan) as client, client.stream("POST", f"/{plan}/v1/completions",
                                                    json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if on_first is not None and len(events) == 2:
                on_first()
    return events


def _tokens(events) -> list[int]:
    return [t for e in events if isinstance(e, dict) and "choices" in e
            for t in e["choices"][0].get("token_ids") or []]


def _errors(events) -> list[dict]:
    return [e["error"] for e in events if isinstance(e, dict) and "error" in e]


def _finish(events):
    reasons = [e["choices"][0].get("finish_reason") for e in events
               if isinstance(e, dict) and "choices" in e]
    return next((r for r in reversed(reasons) if r), None)


def _succeeds_within(app, plan: str, since: float) -> float:
    """Send requests until one succeeds; returns seconds since `since` (fails past RECOVERY_S)."""
    while True:
        try:
            with app.client(plan, timeout=RECOVERY_S) as client:
                r = client.post(f"/{plan}/v1/completions",
                                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
            if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4:
                return time.time() - since
        except Exception:         # connection reset while the replica is replaced
            pass
        assert time.time() - since < RECOVERY_S, f"no {plan} request succeeded in {RECOVERY_S}s"
        time.sleep(0.5)


def _no_kv_in_use(app, deployment: str, timeout_s: float = 15.0) -> dict:
    deadline = time.time() + timeout_s
    while True:
        stats = app.handle(deployment).stats.remote().result(timeout_s=30)["stats"]
        used = stats["kv_used_target_bytes"] + stats["kv_used_draft_bytes"]
        if used == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        assert time.time() < deadline, f"{deployment} still holds KV: {stats}"
        time.sleep(0.5)


def test_a_failing_draft_leaves_the_stream_on_the_target_in_baseline(app):
    target = app.handle("TargetServer")
    baseline = _tokens(_stream(app, "standard", max_tokens=200, speculation="off"))
    # Armed before the stream, to fire at the draft's second forward (mid-stream, no race).
    target.inject_fault.remote("draft_raise", after=1).result(timeout_s=30)
    events = _stream(app, "premium", max_tokens=200, speculation="on")
    assert not _errors(events) and events[-1] == "[DONE]"
    assert _finish(events) == "length"
    usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")][-1]
    assert usage["tier"] == "speculative" and usage["reason"] == "draft_unavailable"
    assert _tokens(events) == baseline                       # greedy: the target's tokens
    metrics = target.stats.remote().result(timeout_s=30)["metrics"]
    assert metrics["num_draft_failures"] == 1
    # A new speculative request drafts again (the fault was one forward).
    with app.client("premium") as client:
        r = client.post("/premium/v1/completions",
                        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                              "speculation": "on"})
    assert r.status_code == 200 and r.json()["usage"]["reason"] != "draft_unavailable"
    assert r.headers["x-specserve-reason"] == r.json()["usage"]["reason"]
    _no_kv_in_use(app, "TargetServer")


def test_killing_the_small_replica_mid_stream(app):
    small = app.handle("SmallServer")
    pid = small.stats.remote().result(timeout_s=30)["pid"]
    killed = {}

    def kill():
        killed["at"] = time.time()
        os.kill(pid, signal.SIGKILL)

    events = _stream(app, "economy", on_first=kill, max_tokens=400)
    assert killed, "the stream ended before the kill"
    assert _errors(events), f"the stream did not end with an error: {events[-3:]}"
    assert _finish(events) != "length"
    took = _succeeds_within(app, "economy", killed["at"])
    print(f"small tier serving again {took:.1f}s after the kill")
    stats = _no_kv_in_use(app, "SmallServer")
    assert small.stats.remote().result(timeout_s=30)["pid"] != pid and stats is not None


def test_killing_a_tp_rank_mid_stream(app):
    target = app.handle("TargetServer")
    (rank_pid,) = target.tp_rank_pids.remote().result(timeout_s=30)
    killed = {}

    def kill():
        killed["at"] = time.time()
        os.kill(rank_pid, signal.SIGKILL)

    results, premium_started = {}, threading.Event()

    def premium():
        try:
            results["premium"] = _stream(app, "premium", on_first=premium_started.set,
                                         max_tokens=400, speculation="on")
        except BaseException as e:          # reported below, not lost in the thread
            results["premium"] = e
            premium_started.set()
    # A second stream on the other target tier is in flight too (started before the kill: one
    # sent after it would be refused, 503); both must end, with an error or complete.
    other = threading.Thread(target=premium)
    other.start()
    assert premium_started.wait(60), "the premium stream never started"
    events = _stream(app, "standard", on_first=kill, max_tokens=400, speculation="off")
    other.join(timeout=120)
    assert killed and not other.is_alive()
    assert isinstance(results["premium"], list), results["premium"]
    for evs in (events, results["premium"]):
        assert _errors(evs) or _finish(evs) == "length", evs[-3:]
    assert _errors(events), f"the stream did not end with an error: {events[-3:]}"
    took = _succeeds_within(app, "standard", killed["at"])
    print(f"target tier serving again {took:.1f}s after the rank was killed")
    _no_kv_in_use(app, "TargetServer")
    assert rank_pid not in target.tp_rank_pids.remote().result(timeout_s=30)
