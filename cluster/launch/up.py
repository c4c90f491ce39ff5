"""`specserve up [--config FILE]`: the README's first command.

Builds the demo family if the config needs it and it is missing, starts a local Ray cluster
(token auth on, see `cluster/launch/ray_local.py`), deploys the app, waits until every tier reports,
prints the API, metrics and dashboard URLs with a one-time API key and an example request,
then serves until Ctrl-C or SIGTERM. Stopping is graceful: the ingress stops admitting (new
requests get 503 with Retry-After), the requests in flight run to their end for up to
`--drain-timeout` seconds (a second signal cuts that short), then Serve and Ray are torn down
and the process exits 0. `--check` answers one completion on every pricing endpoint and
exits instead (a smoke test for a fresh clone).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).parents[1] / "configs" / "local.yaml"
LAUNCHER_KEYS = {"num_cpus", "num_gpus", "http_host", "http_port", "direct_ingress", "proxy_port",
                 "dashboard_port", "metrics_port"}


def add_arguments(parser) -> None:
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="app YAML (default: %(default)s)")
    parser.add_argument("--port", type=int, default=None,
                        help="the API's HTTP port (default: the config's launcher.http_port)")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may use")
    parser.add_argument("--no-dashboard", action="store_true", help="start Ray without its dashboard")
    parser.add_argument("--check", action="store_true",
                        help="send one completion to every pricing endpoint, then stop")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM/Ctrl-C, seconds to let requests in flight finish "
                             "(default: %(default)s)")


class StopSignal:
    """SIGTERM and SIGINT as flags: the first asks for a graceful stop, the second forces it.

    Installed after `ray.init`, which replaces the SIGTERM handler with `sys.exit` (that
    raised inside Ray's threads and ended in an abort with a stack dump)."""

    def __init__(self):
        self.requested = self.forced = False
        self.install()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            self.forced = True
        self.requested = True
        print(f"\n{signal.Signals(signum).name}: stopping specserve"
              f"{' now' if self.forced else ' (again to skip the drain)'} ...", flush=True)


def _drain(app_name: str, timeout_s: float, stop: StopSignal) -> None:
    """Stop admitting at the ingress, then wait (bounded) until nothing is in flight.

    Awaited on a loop of its own, by a handle of its own that it shuts down on that loop: in
    Serve's throughput-optimized mode (if the user exported it into this process too) a
    handle's router runs on the caller's event loop, refuses plain `.result()` calls and cannot
    be shut down once that loop is closed (Serve's cached handles are, at shutdown)."""
    from ray.serve.handle import DeploymentHandle

    async def drain() -> None:
        ingress = DeploymentHandle("Ingress", app_name)
        try:
            in_flight = await asyncio.wait_for(ingress.drain.remote(), 10)
            print(f"draining: {in_flight} request(s) in flight (at most {timeout_s:.0f} s) ...",
                  flush=True)
            deadline = time.monotonic() + timeout_s
            while in_flight and time.monotonic() < deadline and not stop.forced:
                await asyncio.sleep(0.25)
                in_flight = await asyncio.wait_for(ingress.in_flight.remote(), 10)
            if in_flight:
                print(f"drain ended with {in_flight} request(s) still in flight: they are cut",
                      flush=True)
            else:
                await asyncio.sleep(0.5)    # the proxy sends the last bytes of the last response
        finally:
            await ingress.shutdown_async()

    try:
        asyncio.run(drain())
    except Exception as exc:        # nothing deployed yet, or the app failed: just tear down
        print(f"drain skipped: {type(exc).__name__}: {exc}", flush=True)


def _launcher(path: str, args) -> dict:
    """The launcher section, as `ray_local.start` takes it. `http_port` is the API's port: with
    `direct_ingress` on, the ingress replica serves it itself (Ray Serve's direct ingress) and
    Serve's proxy serves the same API on `proxy_port`; off, the proxy serves `http_port`."""
    from router.config import read_yaml

    launcher = dict(read_yaml(path).get("launcher") or {})
    unknown = sorted(set(launcher) - LAUNCHER_KEYS)
    if unknown:
        raise LauncherError(f"unknown launcher key(s) {', '.join(unknown)}; known: "
                            f"{', '.join(sorted(LAUNCHER_KEYS))}")
    cpus = args.num_cpus or launcher.get("num_cpus") or len(os.sched_getaffinity(0))
    api_port = args.port or launcher.get("http_port", 8000)
    direct = launcher.get("direct_ingress", False)
    if not isinstance(direct, bool):
        raise LauncherError(f"launcher.direct_ingress must be true or false, not {direct!r}")
    proxy_port = launcher.get("proxy_port", 8002) if direct else api_port
    for name, port in (("http_port", api_port), ("proxy_port", proxy_port)):
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise LauncherError(f"launcher.{name} {port!r} must be a port (1-65535)")
    if direct and proxy_port == api_port:
        raise LauncherError(f"launcher.proxy_port must differ from the API's port {api_port}")
    return {"num_cpus": max(2, int(cpus)), "num_gpus": launcher.get("num_gpus"),
            "http_host": launcher.get("http_host", "127.0.0.1"),
            "http_port": proxy_port, "direct_ingress_port": api_port if direct else None,
            "dashboard_port": launcher.get("dashboard_port", 8265),
            "metrics_port": launcher.get("metrics_port")}


class LauncherError(ValueError):
    """A launcher section `specserve up` cannot start: the user's error, one line, exit 2."""


def _port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket() as sock:
        # as the server will bind it (uvicorn sets SO_REUSEADDR): a stopped server's connections
        # in TIME_WAIT do not keep the port from it, a listener does
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _wait_healthy(url: str, timeout_s: float = 600, stop: StopSignal | None = None) -> None:
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline and not (stop and stop.requested):
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    if stop and stop.requested:
        return
    raise TimeoutError(f"the app at {url} did not become healthy within {timeout_s:.0f}s")


def _check(url: str, key: str, model: str) -> bool:
    import httpx

    ok = True
    for prefix in ("/v1", "/premium/v1", "/standard/v1", "/economy/v1"):
        r = httpx.post(f"{url}{prefix}/completions", timeout=120,
                       headers={"Authorization": f"Bearer {key}"},
                       json={"model": model, "prompt": "def fibonacci(n):", "max_tokens": 16})
        usage = r.json().get("usage", {}) if r.status_code == 200 else {}
        print(f"  {prefix + '/completions':28s} {r.status_code}  tier={usage.get('tier')} "
              f"price_usd={usage.get('price_usd')}")
        if r.status_code != 200:
            print(f"    {r.text[:500]}")
        ok &= r.status_code == 200
    return ok


def _print_banner(local, cfg, key: str) -> None:
    api = local.direct_url or local.api_url
    proxy = (f"  API, via Serve's proxy   {local.api_url}/v1   (the same API, one process hop "
             f"more)\n" if local.direct_url else "")
    print(f"""
specserve is up.
  API (OpenAI-compatible)  {api}/v1   (also /premium/v1, /standard/v1, /economy/v1)
{proxy}  metrics (Prometheus)     {local.metrics_url}
  Ray dashboard            {local.dashboard_url or 'off'}   (log in with the token in {local.token_path})
  API key for this run     {key}   (plan: auto; make lasting ones with `specserve keys add`)

Try it:
  curl {api}/v1/completions -H "Authorization: Bearer {key}" \\
       -H "Content-Type: application/json" \\
       -d '{{"model": "{cfg.model_name}", "prompt": "def fibonacci(n):", "max_tokens": 32}}'

  python -c "import openai; c = openai.OpenAI(base_url='{api}/v1', api_key='{key}'); \\
print(c.completions.create(model='{cfg.model_name}', prompt='def fibonacci(n):', max_tokens=32))"

Ctrl-C stops it.
""", flush=True)


def run(args) -> int:
    from cluster.launch import ray_local
    from router.config import InlineKey, load_config, uses_demo_family
    from router.keys import make_record

    demo_dir = None
    if uses_demo_family(args.config):
        from models.demo import ensure_demo_family

        print("checking the demo model family (built once, a few minutes on CPU) ...", flush=True)
        demo_dir = ensure_demo_family()
    cfg = load_config(args.config, demo_dir)
    key, record = make_record("specserve-up", "auto")       # valid for this run only
    cfg.auth.keys.append(InlineKey(name=record.name, plan="auto", sha256=record.sha256))
    try:
        launcher = _launcher(args.config, args)
        if launcher["direct_ingress_port"] and cfg.ingress_num_replicas > 1:
            raise LauncherError("direct ingress serves one ingress replica per node: set "
                                "ingress_num_replicas: 1 or launcher.direct_ingress: false")
    except LauncherError as exc:
        print(f"specserve up: {exc}", file=sys.stderr)
        return 2
    for port in (launcher["direct_ingress_port"], launcher["http_port"]):
        if port and not _port_free(launcher["http_host"], port):
            print(f"specserve up: port {port} is in use; pass --port (the API's) or change "
                  f"the launcher's ports", file=sys.stderr)
            return 2
    if launcher["metrics_port"] and not _port_free("127.0.0.1", launcher["metrics_port"]):
        launcher["metrics_port"] = None          # any free port (printed below)

    stop = StopSignal()
    print(f"starting Ray ({launcher['num_cpus']} CPUs, token auth on) ...", flush=True)
    local = ray_local.start(num_cpus=launcher["num_cpus"], num_gpus=launcher["num_gpus"],
                            http_host=launcher["http_host"], http_port=launcher["http_port"],
                            metrics_port=launcher["metrics_port"], dashboard=not args.no_dashboard,
                            dashboard_port=launcher["dashboard_port"],
                            direct_ingress_port=launcher["direct_ingress_port"],
                            worker_niceness=0)
    stop.install()
    try:
        from ray import serve

        from deployments.app import build_app

        if stop.requested:
            return 0
        print("deploying the app (loading models, profiling the engine) ...", flush=True)
        serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.route_prefix, blocking=False)
        api = local.direct_url or local.api_url
        _wait_healthy(api, stop=stop)
        if not stop.requested:
            _print_banner(local, cfg, key)
            if args.check:
                return 0 if _check(api, key, cfg.model_name) else 1
        while not stop.requested:
            time.sleep(0.2)
        _drain(cfg.name, args.drain_timeout, stop)
    finally:
        print("\nstopping specserve ...", flush=True)
        ray_local.stop()
        print("stopped.", flush=True)
    return 0


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(run(p.parse_args()))
