"""Start and stop a local Ray cluster for specserve, with token authentication on, on purpose.

Ray 2.60 turns token authentication on by default for a cluster started by `ray.init()`: it
writes a random token to `~/.ray/auth_token` if none exists and then every RPC, the dashboard
(8265) and `serve deploy` need it. We do not leave that to the default: `enable_token_auth()`
sets `RAY_AUTH_MODE=token`, points `RAY_AUTH_TOKEN_PATH` at a token file it creates with mode
0600 when missing (default: Ray's own `~/.ray/auth_token`), and refreshes Ray's cached config
so a process that already imported Ray sees the mode (without that refresh the driver keeps
'disabled' while the GCS it starts demands a token, and `ray.init` fails). Worker processes
inherit the environment. The Serve HTTP port (the OpenAI API) is not covered by Ray's token;
it has specserve's own API keys. The metrics export port is unauthenticated, like Prometheus
expects; both bind to the addresses Ray chooses (use a firewall on shared hosts).

`direct_ingress_port` serves the API from the ingress replica's own HTTP server on that port,
one process hop shorter than Serve's proxy (Ray 2.60's direct ingress, a feature
flag read from the environment by the controller and the replicas, so it is set here before
Ray starts and restored by `stop`). The proxy keeps serving `http_port` beside it. The port
range is that one port (the app has one ingress replica) and its quarantine is 0: the
quarantine keeps a freed port from HAProxy, which specserve does not run, and would keep a
restarted ingress off its port for minutes. `specserve up` puts the API's own port here when
the launcher asks for `direct_ingress` (the local configs do), and the proxy on `proxy_port`.
What the hop saves: docs/decisions/0034-api-from-the-ingress-replica.md.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from models.rendezvous import free_port

logger = logging.getLogger(__name__)
DEFAULT_TOKEN_PATH = Path.home() / ".ray" / "auth_token"
# what ray.init raises when its processes did not come up within its fixed waits
STARTUP_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")
_saved_env: dict[str, str | None] = {}       # what `start` changed, restored by `stop`


def direct_ingress_env(port: int) -> dict[str, str]:
    """Ray Serve's direct ingress on exactly `port` (range [port, port + 1)), no quarantine and
    no minimum drain (Serve holds a stopping ingress open 30 s for a load balancer to notice;
    none runs here, and `specserve up` drains requests in flight itself)."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
            "RAY_SERVE_PORT_QUARANTINE_S": "0",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


def serve_speed_env(direct_ingress: bool) -> dict[str, str]:
    """Ray Serve's own throughput-optimized mode, and direct ingress pinned to what was asked.

    `RAY_SERVE_THROUGHPUT_OPTIMIZED=1` (Ray 2.60, `ray/serve/_private/constants.py`) runs each
    replica's user code and its handles' router on the replica's main event loop instead of a
    thread and a loop of their own, calls between deployments over gRPC, buffers the access log
    and keeps it off stderr, and freezes the startup objects out of the garbage collector.
    It halves the handle hops of a lone request's first token
    (docs/decisions/0014-serving-path-hops.md). It needs replicas whose code never blocks the loop
    (the engine's calls are awaited or run in a thread: deployments/engine_server.py). The mode
    also turns direct ingress on by default; here it stays exactly what the launcher asked for.
    A value the user exported wins over both."""
    env = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    if not direct_ingress:
        env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "0"
    return {name: value for name, value in env.items() if name not in os.environ}


def worker_priority_env(niceness: int) -> dict[str, str]:
    """Ray starts its worker processes (every Serve replica, and the engine processes they
    start) at niceness 15 unless told otherwise, below any plain process on the machine: a
    load client or an agent beside them takes a core from the engine first. `specserve up` runs
    them at 0, as any server is (docs/decisions/0034-api-from-the-ingress-replica.md). A value
    the user exported wins."""
    name = "RAY_worker_niceness"
    return {} if name in os.environ else {name: str(niceness)}


def _set_env(values: dict[str, str]) -> None:
    for name, value in values.items():
        _saved_env.setdefault(name, os.environ.get(name))
        os.environ[name] = value


def _restore_env() -> None:
    for name, value in _saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _saved_env.clear()


def ensure_token(path: str | Path | None = None) -> Path:
    """The token file, created (0600, 64 hex characters) if missing or empty."""
    path = Path(path or os.environ.get("RAY_AUTH_TOKEN_PATH") or DEFAULT_TOKEN_PATH).expanduser()
    if not path.exists() or not path.read_text().strip():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32))
    return path


def enable_token_auth(token_path: str | Path | None = None) -> Path:
    """Turn on token auth for this process and the Ray processes it starts; returns the file."""
    path = ensure_token(token_path)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    os.environ.pop("RAY_AUTH_TOKEN", None)     # the file is the one source of truth
    try:   # Ray caches its config (and the token) on first use: make it re-read the environment
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):      # a Ray without token auth: nothing cached
        pass
    return path


def auth_headers() -> dict[str, str]:
    """Headers for Ray's own HTTP APIs (dashboard, jobs, `serve deploy`) on this cluster."""
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or DEFAULT_TOKEN_PATH).expanduser()
    return {"Authorization": f"Bearer {path.read_text().strip()}"} if path.exists() else {}


@dataclass
class LocalRay:
    http_host: str
    http_port: int
    metrics_port: int
    dashboard_url: str | None
    token_path: Path
    direct_ingress_port: int | None = None

    @property
    def api_url(self) -> str:
        return f"http://{self.http_host}:{self.http_port}"

    @property
    def direct_url(self) -> str | None:
        """The API served by the ingress replica itself (None unless direct ingress is on)."""
        port = self.direct_ingress_port
        return f"http://{self.http_host}:{port}" if port else None

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


def _children() -> dict[int, str]:
    """This process's descendants: pid -> name."""
    import psutil

    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            found[child.pid] = child.name()
        except psutil.Error:
            pass
    return found


def _stop_new_children(before: dict[int, str]) -> dict[int, str]:
    """Stop the descendants that are not in `before` (what a failed start left running: Ray
    spawns its GCS, raylet, monitor and dashboard as this driver's children, and a start that
    timed out does not stop them). Returns those it stopped."""
    import psutil

    left = {pid: name for pid, name in _children().items() if pid not in before}
    procs = []
    for pid in left:
        try:
            procs.append(psutil.Process(pid))
            procs[-1].terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return left


def start_with_retry(start_fn, cleanup=None):
    """Call `start_fn` (a Ray start: `ray.init`, `Cluster(...)`); if it misses Ray's fixed 30 s
    wait for its processes (a loaded machine: a test worker beside another starting a cluster),
    stop what it left running, say which of Ray's processes were up, and try once more.

    Without the stop, the failed start's GCS and monitor keep running and load the machine
    during the retry, which then times out as well."""
    before = _children()
    try:
        return start_fn()
    except Exception as exc:
        if not any(text in str(exc) for text in STARTUP_TIMEOUTS):
            raise
        if cleanup is not None:
            cleanup()
        left = _stop_new_children(before)
        logger.warning("the local Ray cluster did not come up in time (%s); processes up: %s; "
                       "stopped them and starting it again", exc,
                       ", ".join(sorted(set(left.values()))) or "none")
        return start_fn()


def start(num_cpus: int, num_gpus: int | None = None, http_host: str = "127.0.0.1",
          http_port: int = 8000, metrics_port: int | None = None, dashboard: bool = True,
          dashboard_port: int = 8265, token_path: str | Path | None = None,
          direct_ingress_port: int | None = None, address: str | None = None,
          proxy_location: str | None = None, worker_niceness: int | None = None) -> LocalRay:
    """Start a local Ray cluster (this process is its driver) and Serve's HTTP proxy, Serve in
    its throughput-optimized mode (`serve_speed_env`; the user's exported value wins).

    `num_cpus` is always explicit: Ray's default (every core) oversubscribes small machines.
    `address` joins a cluster already running (nodes started with token auth on, the same
    token file, e.g. several nodes of `ray.cluster_utils.Cluster` on one machine) instead; its
    nodes' resources are their own, `metrics_port` is the head's. `proxy_location` is Serve's
    (default: a proxy on every node; "HeadOnly" where the nodes share one address and port).
    `worker_niceness`: the niceness of Ray's worker processes (None: Ray's own 15).
    """
    if direct_ingress_port is not None:
        if direct_ingress_port == http_port:
            raise ValueError("direct_ingress_port must differ from http_port (the proxy's)")
        _set_env(direct_ingress_env(direct_ingress_port))
    import ray
    from ray import serve       # this driver's Serve settings are read here, before the mode's

    # For the processes ray.init starts (they inherit the environment), not this driver: its
    # handles are called from plain code (`.result()`), which a handle whose router runs on the
    # caller's event loop refuses.
    _set_env(serve_speed_env(direct_ingress_port is not None))
    if worker_niceness is not None:
        _set_env(worker_priority_env(worker_niceness))
    path = enable_token_auth(token_path)

    metrics_port = metrics_port or free_port()
    # address "local": always a new cluster. Without it, ray.init() attaches to the last
    # cluster `ray start` (or ray.cluster_utils) left running on the machine, if any.
    options = dict(address="local", num_cpus=num_cpus, num_gpus=num_gpus,
                   include_dashboard=dashboard, dashboard_host="127.0.0.1",
                   dashboard_port=dashboard_port, _metrics_export_port=metrics_port,
                   log_to_driver=False, namespace="specserve")
    if address is not None:
        options = dict(address=address, log_to_driver=False, namespace="specserve")
    context = start_with_retry(lambda: ray.init(**options), cleanup=ray.shutdown)
    serve.start(http_options={"host": http_host, "port": http_port},
                **({"proxy_location": proxy_location} if proxy_location else {}))
    url = getattr(context, "dashboard_url", None)
    dashboard_url = f"http://{url}" if dashboard and url else None
    return LocalRay(http_host, http_port, metrics_port, dashboard_url, path, direct_ingress_port)


def stop(graceful: bool = True) -> None:
    """Tear down what `start` began: Serve apps first (each replica finishes what it holds,
    seconds), then this driver's Ray cluster. `graceful=False` skips Serve's shutdown: the
    cluster's processes are stopped with it (tests, whose requests are over).

    Never `ray stop`: that kills every Ray process of this user, other clusters' too.
    """
    import ray
    from ray import serve

    try:
        if ray.is_initialized():
            try:
                if graceful:
                    serve.shutdown()
            finally:
                ray.shutdown()
    finally:
        _restore_env()
