"""`specserve status`: tiers, replicas and load of a running specserve app.

Connects to the running cluster as a driver (token auth handled by `cluster/launch/ray_local.py`),
reads Serve's application and replica states, and asks the ingress's `/health` for the live
per-tier load (replicas reporting, running batch, waiting queue, KV headroom); `/health` shows
that only to an admin key, taken from $SPECSERVE_ADMIN_KEY.
"""

from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("--address", default="auto", help="Ray address (default: %(default)s)")
    parser.add_argument("--app", default="specserve", help="Serve application name")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the app's HTTP address")


def run(args) -> int:
    import os

    import httpx

    from cluster.launch.ray_local import enable_token_auth

    enable_token_auth()
    import ray
    from ray import serve

    ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
    try:
        status = serve.status()
        app = status.applications.get(args.app)
        if app is None:
            print(f"no application '{args.app}' (found: {sorted(status.applications)})")
            return 1
        print(f"application {args.app}: {app.status.value}")
        for name, dep in app.deployments.items():
            replicas = ", ".join(f"{state.value if hasattr(state, 'value') else state}={n}"
                                 for state, n in dep.replica_states.items())
            print(f"  {name:14s} {dep.status.value:10s} replicas: {replicas or 'none'}")
    finally:
        ray.shutdown()
    try:
        admin = os.environ.get("SPECSERVE_ADMIN_KEY", "")
        health = httpx.get(args.url + "/health", timeout=5,
                           headers={"Authorization": f"Bearer {admin}"} if admin else None).json()
    except (httpx.HTTPError, ValueError) as exc:
        print(f"live load unavailable from {args.url}/health: {exc}")
        return 0
    if "tiers" not in health:
        print(f"ingress: {health.get('status')} (set $SPECSERVE_ADMIN_KEY for the live load)")
        return 0
    print("live load (from the router's stats):")
    for tier, t in health.get("tiers", {}).items():
        tiers = "speculative + baseline" if tier == "target" else "small"
        print(f"  {tier:7s} ({tiers}): {t['replicas']} replica(s) reporting, running {t['running']}, "
              f"waiting {t['waiting']}, KV headroom {t['kv_headroom']:.0%}")
    return 0
