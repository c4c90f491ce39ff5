"""A tier with `autoscaling:` on a real local cluster: Serve's controller runs the tier's policy
(router/autoscaling.py) on what the replicas report; under load the small tier grows to two
replicas, and when the load falls it shrinks to one while streams are in flight on both, and
every stream ends complete (a removed replica finishes its streams before it stops)."""

from __future__ import annotations

import os
import sys
import threading
import time

import httpx
import pytest

from cluster.launch.status import replica_counts, serve_replicas
from serving_helpers import MODEL, served_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# Serve's replicas and handles push their autoscaling metrics every 10 s by default; the
# controller and the replicas read these at start, so they are set before the cluster starts.
FAST_METRICS = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
                "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
                "RAY_metrics_report_interval_ms": "1000"}     # Prometheus export: 10 s default
RULE = {"min_replicas": 1, "max_replicas": 2, "target_sequences": 2, "downscale_share": 1.0,
        "upscale_delay_s": 0.0, "downscale_delay_s": 2.0, "look_back_s": 1.0,
        "graceful_shutdown_s": 120.0}


@pytest.fixture(scope="module")
def app(long_family, module_tmp):
    saved = {k: os.environ.get(k) for k in FAST_METRICS}
    os.environ.update(FAST_METRICS)
    try:
        with served_app(module_tmp, long_family, small={"autoscaling": RULE}) as served:
            yield served
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _running(app, state: str = "RUNNING") -> int:
    return replica_counts("specserve", state)["SmallServer"]


def _wait(predicate, timeout_s: float, what: str) -> float:
    deadline = time.time() + timeout_s
    while not predicate():
        if time.time() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.25)
    return time.time()


def _stream(app, max_tokens: int, out: list) -> None:
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    usage, status = None, None
    with app.client("economy", timeout=180) as client, \
            client.stream("POST", "/economy/v1/completions", json=body) as r:
        status = r.status_code
        if status != 200:       # shown with a failure: the refusal's reason
            print(f"economy stream got {status}: {r.read()[:500]!r}", file=sys.stderr)
        for line in r.iter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                import json

                usage = json.loads(line[6:]).get("usage") or usage
    out.append((status, usage and usage["completion_tokens"], time.time()))


def test_the_small_tier_scales_up_under_load_and_down_with_streams_in_flight(app):
    assert _running(app) == 1
    done: list = []
    stop = threading.Event()

    def user():
        while not stop.is_set():
            _stream(app, 600, done)
    # load: six users streaming one request after another, on a tier that aims at two
    # sequences a replica, until the autoscaler starts a second replica (which then starts
    # without the load on the two cores; the rule holds while it starts)
    load = [threading.Thread(target=user) for _ in range(6)]
    for t in load:
        t.start()
    try:
        _wait(lambda: _running(app, "STARTING") + _running(app) == 2, 90,
              "the autoscaler starting a second small replica")
    finally:
        stop.set()
        for t in load:
            t.join(180)
    up_at = _wait(lambda: _running(app) == 2, 90, "a second small replica")
    # two long streams, one on each replica (least loaded first), then no more load: the tier
    # asks for one replica while both are in flight
    inflight: list = []
    streams = [threading.Thread(target=_stream, args=(app, 3500, inflight)) for _ in range(2)]
    for t in streams:
        t.start()
        time.sleep(0.3)
    admin = {"Authorization": f"Bearer {app.admin_key}"}

    def per_replica() -> dict:
        tiers = httpx.get(app.url + "/health", headers=admin).json()["tiers"]
        return tiers["small"]["per_replica"]
    busy: dict = {}
    _wait(lambda: len(busy.update(per_replica()) or busy) == 2
          and all(r["running"] == 1 for r in busy.values()), 20, "a stream on each replica")
    down_at = _wait(lambda: _running(app) == 1, 90, "back to one small replica")

    def alive() -> set:
        return {r["replica"] for r in serve_replicas("specserve")
                if r["deployment"] == "SmallServer" and r["actor_state"] == "ALIVE"}
    _wait(lambda: len(alive()) == 1, 60, "the removed replica's actor gone")
    removed = set(busy) - alive()
    for t in streams:
        t.join(180)
    assert done and all(s == 200 and n == 600 for s, n, _ in done), done
    assert [s for s, _, _ in inflight] == [200] * 2, inflight
    assert [n for _, n, _ in inflight] == [3500] * 2, inflight       # none cut
    # the count fell while streams ran (seen by polling Serve, so up to a poll late)
    assert down_at < max(t for _, _, t in inflight), "the scale-down came after the streams"
    assert up_at < down_at
    assert len(removed) == 1, (busy, removed)    # it held one of the streams when it went
    with app.client("economy") as client:     # the tier serves on its one replica
        r = client.post("/economy/v1/completions", json={"model": MODEL, "prompt": "x",
                                                          "max_tokens": 4})
    assert r.status_code == 200 and httpx.get(app.url + "/health").status_code == 200
    # the controller's decisions reach Prometheus (the dashboard's scaling panel)
    _wait(lambda: all(f'reason="{why}"' in httpx.get(app.metrics_url, timeout=10).text
                      for why in ("queue_over_target", "stable_low")), 60,
          "ray_specserve_scaling_decisions_total on the export port")


def test_an_idle_small_tier_scales_to_zero_and_economy_wakes_it_without_waiting(app):
    """With `min_replicas: 0` the idle small tier goes to zero replicas; an economy request then
    runs on baseline at once (reason small_cold, at the small tier's price) and wakes the small
    tier, which serves economy again once its replica is up."""
    from router.billing import RunCounts, price_micro_usd
    from router.config import AppConfig
    from serving_helpers import redeploy

    redeploy(app, small={"autoscaling": {**RULE, "min_replicas": 0}})
    _wait(lambda: _running(app) == 0, 90, "the idle small tier at zero replicas")
    # ... and so in the router's view (up to a stats period later: a request sent before then
    # goes to the small tier and waits for its cold start, docs/decisions/0032-autoscaling.md)
    admin = {"Authorization": f"Bearer {app.admin_key}"}
    _wait(lambda: httpx.get(app.url + "/health", headers=admin).json()["tiers"]["small"]
          ["replicas"] == 0, 30, "the router seeing no small replica")
    prices = AppConfig.model_validate(app.config).prices

    def economy():
        with app.client("economy") as client:
            r = client.post("/economy/v1/completions",
                            json={"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 8})
        assert r.status_code == 200, r.text
        return r
    cold = economy()
    usage = cold.json()["usage"]
    assert (cold.headers["x-specserve-tier"], cold.headers["x-specserve-reason"]) == (
        "baseline", "small_cold")
    small_price = price_micro_usd(prices, RunCounts("small", usage["prompt_tokens"],
                                                    usage["completion_tokens"]))
    assert round(usage["price_usd"] * 1e6) == small_price
    _wait(lambda: _running(app) == 1, 90, "a small replica woken by the cold request")
    _wait(lambda: economy().headers["x-specserve-tier"] == "small", 60,
          "economy on the small tier again")
