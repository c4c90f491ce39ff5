"""Helpers: a real local Ray cluster with the specserve app on tiny random models.

The machine this runs on may have 2 cores shared with other work: Ray starts with an explicit
`num_cpus`, replicas run one torch thread, and every module tears its cluster down (Serve
first, then Ray; never `ray stop`, which would kill other users' clusters). Token auth is on,
with a token file in the test's tmp dir.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import httpx

from router.keys import hash_key, make_record, new_key
from router.policy import PLANS

APP_NAME = "specserve"
MODEL = "tiny"


@dataclass
class ServedApp:
    url: str
    metrics_url: str
    keys: dict[str, str] = field(default_factory=dict)     # plan -> API key
    admin_key: str = ""
    ledger_url: str = ""
    direct_url: str | None = None          # the ingress replica's own server (direct ingress)
    config: dict = field(default_factory=dict)   # the app config it was deployed with

    def client(self, plan: str = "auto", timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout,
                            headers={"Authorization": f"Bearer {self.keys[plan]}"})

    def async_client(self, plan: str = "auto", timeout: float = 120.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=timeout,
                                 headers={"Authorization": f"Bearer {self.keys[plan]}"})

    def handle(self, deployment: str):
        from ray import serve

        return serve.get_deployment_handle(deployment, app_name=APP_NAME)


def app_config(family: dict, keys: list, **overrides) -> dict:
    cfg = {"model_name": MODEL,
           "target": {"model": str(family["target"]), "draft": str(family["draft"]),
                      "num_cpus_per_rank": 0.5, "kv_budget_bytes": 8 << 20},
           "small": {"model": str(family["small"]), "num_cpus_per_rank": 0.5,
                     "kv_budget_bytes": 4 << 20},
           "auth": {"keys": keys}, "stats": {"period_s": 0.5}}
    for section, values in overrides.items():
        if isinstance(values, dict) and isinstance(cfg.get(section), dict):
            cfg[section] = {**cfg[section], **values}
        else:
            cfg[section] = values
    return cfg


# The "long-serving" group's app (tests/app_groups.py), on the long-context family. The small
# tier takes one request at a time and queues one more: the overload test fills it; the other
# tests never send it two at once. The tiny draft costs as much as the tiny target, so adaptive
# k would never draft: draft k_max every step instead.
LONG_SERVING = {"target": {"engine_args": {"adaptive_k": False}},
                "small": {"max_ongoing_requests": 1, "max_queued_requests": 1}}

_SHARED: dict = {"group": None, "stack": None, "app": None, "config": None}


def shared_app(group: str, tmp_path, family: dict, **overrides) -> ServedApp:
    """The app of a group's modules (tests/app_groups.py; one config): started by the first of
    them, kept for the next, stopped when a test of another module comes next on this worker
    (tests/deployments/conftest.py) or a module starts a cluster of its own."""
    if _SHARED["group"] == group:
        if _SHARED["config"] != (family, overrides):
            raise ValueError(f"the modules of app group {group!r} must serve one config")
        return _SHARED["app"]
    close_shared()
    stack = contextlib.ExitStack()
    _SHARED["app"] = stack.enter_context(served_app(tmp_path, family, **overrides))
    _SHARED.update(group=group, stack=stack, config=(family, overrides))
    return _SHARED["app"]


def close_shared(unless_group: str | None = None) -> None:
    """Stop the shared app, unless it is `unless_group`'s."""
    if _SHARED["stack"] is not None and _SHARED["group"] != unless_group:
        stack = _SHARED["stack"]
        _SHARED.update(group=None, stack=None, app=None, config=None)
        stack.close()


@contextlib.contextmanager
def served_app(tmp_path, family: dict, num_cpus: int = 4, direct_ingress: bool = False,
               cluster=None, **overrides):
    """Start Ray (token auth on), deploy the app, wait until every tier reports stats.
    `cluster`: a `ray.cluster_utils.Cluster` already started (token auth on, its token file at
    tmp_path/ray_token) to join instead, one Serve proxy on its head."""
    from ray import serve

    close_shared()                  # one Ray cluster per process

    from cluster.launch import ray_local
    from models.rendezvous import free_port
    from deployments.app import build_app

    keys, inline = {}, []
    for plan in PLANS:
        key, record = make_record(f"test-{plan}", plan)
        keys[plan] = key
        inline.append({"name": record.name, "plan": plan, "sha256": record.sha256})
    admin_key = new_key()
    ledger_url = f"sqlite:///{tmp_path}/ledger.db"
    overrides.setdefault("ledger", {"url": ledger_url, "drain_period_s": 0.2})
    auth = {"keys": inline, "admin_keys": [hash_key(admin_key)], "refresh_s": 0.5}
    overrides["auth"] = {**auth, **overrides.get("auth", {})}
    joined = {} if cluster is None else dict(
        address=cluster.address, proxy_location="HeadOnly",
        metrics_port=cluster.head_node.metrics_export_port)
    # Ray's workers at niceness 0, as `specserve up` runs them: at Ray's 15 a replica waits
    # behind any test the other pytest worker runs in its own process
    local = ray_local.start(num_cpus=num_cpus, http_port=free_port(), dashboard=False,
                            token_path=tmp_path / "ray_token", worker_niceness=0,
                            direct_ingress_port=free_port() if direct_ingress else None, **joined)
    try:
        config = app_config(family, inline, **overrides)
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        app = ServedApp(local.api_url, local.metrics_url, keys, admin_key,
                        overrides["ledger"].get("url", ""), local.direct_url, config)
        deadline = time.time() + 120
        while time.time() < deadline:
            if httpx.get(app.url + "/health", timeout=10).status_code == 200:
                break
            time.sleep(0.5)
        else:
            raise TimeoutError("the app did not report every tier healthy within 120 s")
        yield app
    finally:
        ray_local.stop(graceful=False)     # the module's requests are over: no drain


def redeploy(app: ServedApp, **overrides) -> None:
    """Deploy the app again, its config's sections changed by `overrides` (none: as it was
    first deployed), replacing its replicas; wait until every tier reports stats."""
    from ray import serve

    from deployments.app import build_app

    config = {**app.config, **{section: {**app.config[section], **values}
                               for section, values in overrides.items()}}
    serve.run(build_app(config), name=APP_NAME, route_prefix="/")
    deadline = time.time() + 120
    while httpx.get(app.url + "/health", timeout=10).status_code != 200:
        if time.time() > deadline:
            raise TimeoutError("the app did not report every tier healthy within 120 s")
        time.sleep(0.5)


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of an SSE response, `[DONE]` included as a string."""
    import json

    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
