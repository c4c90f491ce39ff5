"""A node dies under load: Ray nodes on this machine (`ray.cluster_utils`).

The head holds the ingress, Serve's one proxy and the target tier (custom resource
`target_node`); a second node has the resource `small_node` and no CPU, so only the small
tier's replica goes there, by the `resources` of its config. Under load (a long economy
stream, economy streams and short requests, standard requests beside them) that node is
removed, its processes killed, and a new node with `small_node` joins 10 s later, as a cloud
autoscaler's would. Then:
- every request in flight ends: completed, an SSE error event in its stream, or an OpenAI-shaped
  error (a 503 with Retry-After) before its first byte; none hangs;
- a cut stream is in the ledger as an error, with its partial usage;
- economy requests go to the baseline tier (`tier_down`) while the small tier has no replica,
  and none of them waits for the replacement: a call that waits at the dead tier's handle is
  sent to baseline (router/ingress.py: `Ingress._first`); the standard tier never fails;
- Serve places the replica on the new node and economy is served by the small tier again,
  within 60 s of the kill.
The head checks its nodes' health every second (three misses: dead) and the router counts a
replica's stats as missing after 3 s, so the dead replica is noticed within seconds.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from cluster.launch import ray_local
from cluster.launch.status import serve_replicas
from router.ledger import read_records
from router.store import Database
from serving_helpers import APP_NAME, MODEL, served_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RECOVERY_S = 60.0
NEW_NODE_AFTER_S = 10.0     # the replacement node joins this long after the kill
PROMPT = "def add(a, b):"
FAST_HEALTH = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
               "health_check_failure_threshold": 3}


@pytest.fixture(scope="module")
def cluster(module_tmp):
    from ray.cluster_utils import Cluster

    ray_local.enable_token_auth(module_tmp / "ray_token")    # the nodes and the driver share it
    head = {"num_cpus": 3, "resources": {"target_node": 1}, "include_dashboard": False,
            "_system_config": FAST_HEALTH}
    # each node's start may miss Ray's fixed 30 s on a loaded machine: once more (ray_local)
    nodes = ray_local.start_with_retry(lambda: Cluster(initialize_head=True, head_node_args=head))
    small_nodes = [ray_local.start_with_retry(
        lambda: nodes.add_node(num_cpus=0, resources={"small_node": 1}))]
    try:
        yield nodes, small_nodes
    finally:
        nodes.shutdown()


@pytest.fixture(scope="module")
def app(cluster, long_family, module_tmp):
    nodes, _ = cluster
    with served_app(module_tmp, long_family, cluster=nodes,
                    target={"resources": {"target_node": 1}},
                    small={"num_cpus_per_rank": 0, "resources": {"small_node": 1}},
                    stats={"period_s": 0.5, "stale_after_s": 3.0}) as served:
        yield served


def _alive(deployment: str) -> list[dict]:
    return [r for r in serve_replicas(APP_NAME)
            if r["deployment"] == deployment and r["actor_state"] == "ALIVE"]


class Load:
    """Client threads that send until stopped; every request's outcome is kept."""

    def __init__(self, app):
        self.app = app
        self.results: list[dict] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def _keep(self, result: dict) -> None:
        with self._lock:
            self.results.append(result)

    def stream(self, plan: str, max_tokens: int = 400, started: threading.Event | None = None,
               once: bool = False) -> None:
        """Streams one after the other (`once`: one); sets `started` at a first token."""
        while not self.stop.is_set():
            out = {"plan": plan, "stream": True, "start": time.time(), "events": [],
                   "max_tokens": max_tokens}
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "return_token_ids": True,
                    "stream_options": {"include_usage": True}}
            try:
                with self.app.client(plan, timeout=RECOVERY_S) as client, client.stream(
                        "POST", f"/{plan}/v1/completions", json=body) as r:
                    out["status"], out["headers"] = r.status_code, dict(r.headers)
                    if r.status_code != 200:
                        out["body"] = json.loads(r.read())
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            payload = line[len("data: "):]
                            out["events"].append(payload if payload == "[DONE]"
                                                 else json.loads(payload))
                            if started is not None and _tokens(out) > 0:
                                started.set()
            except Exception as exc:      # a hang (timeout) or a cut connection: a failure
                out["exception"] = repr(exc)
            out["end"] = time.time()
            self._keep(out)
            if once:
                return

    def short(self, plan: str) -> None:
        while not self.stop.is_set():
            out = {"plan": plan, "stream": False, "start": time.time()}
            try:
                with self.app.client(plan, timeout=RECOVERY_S) as client:
                    r = client.post(f"/{plan}/v1/completions",
                                    json={"model": MODEL, "prompt": PROMPT, "max_tokens": 8,
                                          "ignore_eos": True})
                out.update(status=r.status_code, headers=dict(r.headers), body=r.json())
            except Exception as exc:
                out["exception"] = repr(exc)
            out["end"] = time.time()
            self._keep(out)
            time.sleep(0.05)


def _tokens(result: dict) -> int:
    return sum(len(e["choices"][0].get("token_ids") or []) for e in result["events"]
               if isinstance(e, dict) and e.get("choices"))


def _ended_cleanly(result: dict) -> bool:
    """Completed; or an SSE error event; or an OpenAI-shaped error with Retry-After on 503."""
    if "exception" in result:
        return False
    if result["status"] != 200:
        err = result["body"].get("error") or {}
        return bool(err.get("message")) and (result["status"] != 503
                                             or "retry-after" in result["headers"])
    if not result["stream"]:
        return result["body"]["usage"]["completion_tokens"] == 8
    events = result["events"]
    if any(isinstance(e, dict) and "error" in e for e in events):
        return True
    finishes = [e["choices"][0].get("finish_reason") for e in events
                if isinstance(e, dict) and e.get("choices")]
    return events[-1:] == ["[DONE]"] and "length" in finishes


def _reason(result: dict) -> str | None:
    if result.get("status") != 200:
        return None
    if not result["stream"]:
        return result["headers"].get("x-specserve-reason")
    usage = [e["usage"] for e in result["events"] if isinstance(e, dict) and e.get("usage")]
    return usage[-1].get("reason") if usage else None


def _served_again(results: list[dict], killed_at: float) -> float | None:
    """When the first economy request on the small tier ended that started after one was
    sent around the dead tier."""
    around = min((r["start"] for r in results if r["plan"] == "economy"
                  and r["start"] > killed_at and _reason(r) == "tier_down"), default=None)
    return None if around is None else min(
        (r["end"] for r in results if r["plan"] == "economy" and r["start"] > around
         and _reason(r) == "plan_economy"), default=None)


def _id(result: dict) -> str:
    return next(e["id"] for e in result["events"] if isinstance(e, dict) and "id" in e)


def _records(app, ids: set, timeout_s: float = 30.0) -> dict:
    """The ledger records of these request ids, once every one has been drained."""
    deadline = time.time() + timeout_s
    while True:
        found = {r.request_id: r for r in read_records(Database(app.ledger_url))
                 if r.request_id in ids}
        if len(found) == len(ids) or time.time() > deadline:
            assert len(found) == len(ids), f"not in the ledger: {ids - set(found)}"
            return found
        time.sleep(0.3)


def test_a_dead_node_is_routed_around_and_its_tier_placed_again(app, cluster):
    nodes, small_nodes = cluster
    head = nodes.head_node.node_id
    (small,) = _alive("SmallServer")
    assert small["node_id"] in {n.node_id for n in small_nodes}
    assert {r["node_id"] for r in _alive("TargetServer") + _alive("Ingress")} == {head}
    victim = next(n for n in small_nodes if n.node_id == small["node_id"])

    load = Load(app)
    # one long stream on the small replica when its node dies (3000 tokens: seconds)
    victim_started = threading.Event()
    threads = [threading.Thread(target=load.stream, args=("economy", 3000, victim_started, True))]
    threads += [threading.Thread(target=load.stream, args=("economy",)) for _ in range(2)]
    threads += [threading.Thread(target=load.short, args=(plan,))
                for plan in ("economy", "economy", "standard")]
    for t in threads:
        t.start()
    killed = {}
    try:
        time.sleep(2.0)                          # load before the kill
        assert victim_started.wait(30), "the long stream did not start"
        killed["at"] = time.time()
        nodes.remove_node(victim, allow_graceful=False)
        # a node to take its place comes later, as a cloud autoscaler's would
        time.sleep(max(0.0, killed["at"] + NEW_NODE_AFTER_S - time.time()))
        small_nodes.append(ray_local.start_with_retry(
            lambda: nodes.add_node(num_cpus=0, resources={"small_node": 1})))
        # economy goes around the dead tier, then the small tier serves it again (and a few
        # seconds more), within RECOVERY_S of the kill
        back = None
        while time.time() - killed["at"] < RECOVERY_S:
            back = _served_again(list(load.results), killed["at"])
            if back is not None and time.time() > back + 2:
                break
            time.sleep(0.5)
    finally:
        load.stop.set()
        for t in threads:
            t.join(timeout=RECOVERY_S + 10)
    assert not any(t.is_alive() for t in threads), "a client is still waiting"
    results = load.results
    print(f"\n{len(results)} requests; small tier served again "
          f"{(back or float('nan')) - killed['at']:.1f} s after the kill")

    unclean = [r for r in results if not _ended_cleanly(r)]
    assert not unclean, unclean[:3]
    assert back is not None, ("economy was not sent around the dead tier and then served by "
                              f"the small tier again within {RECOVERY_S} s of the kill")
    assert all(r["status"] == 200 for r in results if r["plan"] == "standard")

    after = [r for r in results if r["plan"] == "economy" and r["start"] > killed["at"]]
    assert "tier_down" in {_reason(r) for r in after}, "economy was not sent around the dead tier"
    assert "tier_down" not in {_reason(r) for r in results if r["end"] < killed["at"]}
    # None waits for the replacement (tens of seconds here): a call that waits at the dead
    # tier's handle is sent to baseline once the tier's stats are missing (3 s).
    waited = max(r["end"] - r["start"] for r in after if not r["stream"])
    assert waited < 8.0, f"an economy request took {waited:.1f} s"

    # The streams in flight on the killed node: cut with an error event, in the ledger as
    # errors with what they streamed.
    cut = {_id(r): r for r in results
           if r["stream"] and any(isinstance(e, dict) and "error" in e for e in r["events"])}
    assert any(r["max_tokens"] == 3000 for r in cut.values()), "the long stream was not cut"
    records = _records(app, set(cut))
    for rid, r in cut.items():
        assert records[rid].status == "error" and records[rid].http_status == 503, records[rid]
        assert records[rid].completion_tokens >= _tokens(r)
    print(f"{len(cut)} streams cut; their ledger records: "
          f"{[(x.status, x.completion_tokens) for x in records.values()]}")

    (placed,) = _alive("SmallServer")
    assert placed["node_id"] == small_nodes[-1].node_id
