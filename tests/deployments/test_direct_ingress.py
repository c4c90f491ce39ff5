"""Direct ingress (`launcher.direct_ingress_port`): the ingress replica serves the same API on
its own port, beside Serve's proxy, and the Ray Serve flags it needs are set only for the
cluster that asked and restored when it stops (a later cluster in the same process, a test
module, must not inherit them)."""

from __future__ import annotations

import os

import httpx
import pytest

from cluster.launch import ray_local
from serving_helpers import MODEL, served_app, sse_events

pytestmark = [pytest.mark.ray, pytest.mark.slow]
FLAGS = (*ray_local.direct_ingress_env(1), *ray_local.serve_speed_env(False))


@pytest.fixture(scope="module")
def app(tiny_family, module_tmp):
    before = {name: os.environ.get(name) for name in FLAGS}
    # two target replicas: the last test kills one's engine
    with served_app(module_tmp, tiny_family, direct_ingress=True,
                    target={"num_replicas": 2}) as served:
        yield served
    # stop() put the environment back as it found it
    assert {name: os.environ.get(name) for name in FLAGS} == before


def _post(url: str, key: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


def test_direct_port_is_its_own_server(app):
    assert app.direct_url and app.direct_url != app.url
    assert os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert httpx.get(app.direct_url + "/health", timeout=30).status_code == 200


def test_same_greedy_text_through_both_ports(app):
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0}
    key = app.keys["standard"]
    via_proxy, direct = _post(app.url, key, body), _post(app.direct_url, key, body)
    assert via_proxy.status_code == direct.status_code == 200, direct.text
    assert direct.json()["choices"][0]["text"] == via_proxy.json()["choices"][0]["text"]
    assert direct.json()["usage"]["completion_tokens"] == 12


def test_direct_port_streams_and_prices(app):
    body = {"model": MODEL, "prompt": "x = 1\n", "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", app.direct_url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {app.keys['auto']}"}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 8 and usage["price_usd"] > 0


def test_direct_port_keeps_the_api_errors(app):
    missing_key = httpx.post(app.direct_url + "/v1/completions", timeout=60,
                             json={"model": MODEL, "prompt": "a", "max_tokens": 2})
    assert missing_key.status_code == 401
    assert missing_key.json()["error"]["type"] == "authentication_error"
    bad = _post(app.direct_url, app.keys["auto"], {"model": MODEL, "prompt": "a",
                                                   "max_tokens": -3})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_env_for_one_port():
    env = ray_local.direct_ingress_env(8123)
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "8123"
    assert env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] == "8124"     # range [min, max)
    assert env["RAY_SERVE_PORT_QUARANTINE_S"] == "0"
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"


def test_serve_runs_throughput_optimized_with_direct_ingress_as_asked(monkeypatch):
    for name in ("RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_SERVE_ENABLE_DIRECT_INGRESS"):
        monkeypatch.delenv(name, raising=False)
    # the mode turns direct ingress on by default: off unless the launcher asked for a port
    assert ray_local.serve_speed_env(False) == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
                                                "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
    assert ray_local.serve_speed_env(True) == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0")     # the user's own choice wins
    assert ray_local.serve_speed_env(False) == {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}


def test_same_port_as_the_proxy_is_refused():
    with pytest.raises(ValueError, match="differ"):
        ray_local.start(num_cpus=2, http_port=8555, direct_ingress_port=8555)



def test_with_two_replicas_a_killed_engine_fails_only_its_own_streams(app):
    """Last in the module. One target replica's engine process is killed: requests sent at once
    and after, while the routers' stats still call it available, all succeed (the replica
    answers at once, and the ingress sends a request that has not run to the other replica);
    the killed one restarts in place."""
    import signal
    import time

    target = app.handle("TargetServer")
    before = target.stats.remote().result(timeout_s=30)
    os.kill(before["engine_pid"], signal.SIGKILL)
    deadline, statuses = time.time() + 4.0, []
    while time.time() < deadline:
        r = _post(app.url, app.keys["premium"], {"model": MODEL, "prompt": "def add(a, b):",
                                                  "max_tokens": 2, "temperature": 0})
        statuses.append(r.status_code)
    assert statuses and set(statuses) == {200}, statuses
    while True:                      # the killed replica's engine comes back in place
        seen = {s["pid"]: s for s in (target.stats.remote().result(timeout_s=30)
                                      for _ in range(8))}
        if before["pid"] in seen and seen[before["pid"]]["restarts"] == 1:
            break
        assert time.time() < deadline + 60, "the killed engine did not restart in place"
        time.sleep(0.5)
