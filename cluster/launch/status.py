"""`specserve status`: tiers, replicas and load of a running specserve app.

Connects to the running cluster as a driver (token auth handled by `cluster/launch/ray_local.py`),
reads Serve's application and deployment states, lists each replica (its actor in Ray's control
store: node, process, state), and asks the ingress's `/health` for the live load per tier and per
replica (running batch, waiting queue, KV headroom, engine up or restarting); `/health` shows
that only to an admin key, taken from $SPECSERVE_ADMIN_KEY.

A replica's state: `serving` (its engine reports stats and is up), `restarting` (its engine
process died and is being restarted in place: it answers 503 with Retry-After meanwhile),
`starting` (alive, no stats yet: loading, or the stats are not in), or Ray's actor state when the
actor is not alive (e.g. `DEAD` until Serve replaces it).
"""

from __future__ import annotations

from pathlib import Path

REPLICA_PREFIX = "SERVE_REPLICA::"                     # Serve names replica actors so
TIER_OF = {"TargetServer": "target", "SmallServer": "small"}


def add_arguments(parser) -> None:
    parser.add_argument("--address", default="auto", help="Ray address (default: %(default)s)")
    parser.add_argument("--app", default="specserve", help="Serve application name")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the app's HTTP address")


def replica_counts(app: str, state: str = "RUNNING") -> dict[str, int]:
    """Replicas of each of the app's deployments in a Serve replica state (RUNNING, STARTING,
    ...), from Serve's status (this process is a driver of the cluster)."""
    from ray import serve

    deps = serve.status().applications[app].deployments
    return {name: sum(n for s, n in dep.replica_states.items()
                      if str(getattr(s, "value", s)) == state) for name, dep in deps.items()}


def serve_replicas(app: str) -> list[dict]:
    """The app's replica actors: deployment, replica id, node address and id, pid, actor
    state. Read from Ray's control store (GCS), which answers without the dashboard that Ray's
    state API needs (`specserve up --no-dashboard`, the tests)."""
    from ray._private import state

    out = []
    for info in state.actors().values():
        name = info.get("Name") or ""
        if not name.startswith(REPLICA_PREFIX):
            continue
        parts = name[len(REPLICA_PREFIX):].split("#")
        if len(parts) != 3 or parts[0] != app:
            continue
        out.append({"deployment": parts[1], "replica": parts[2],
                    "node": (info.get("Address") or {}).get("IPAddress", "?"),
                    "node_id": (info.get("Address") or {}).get("NodeID", ""),
                    "pid": info.get("Pid"), "actor_state": info.get("State", "?")})
    return sorted(out, key=lambda r: (r["deployment"], r["replica"]))


def replica_rows(replicas: list[dict], health: dict | None) -> list[dict]:
    """Each replica with its live load from `/health` (admin view; None: none known): state,
    running, waiting and KV headroom (None where the replica reports no load: the ingress, or
    one whose stats are not in). Dead actors stay listed until Ray forgets them."""
    tiers = (health or {}).get("tiers", {})
    rows = []
    for r in replicas:
        load = tiers.get(TIER_OF.get(r["deployment"], ""), {}).get("per_replica", {}).get(r["replica"])
        if r["actor_state"] != "ALIVE":
            state = r["actor_state"]
        elif r["deployment"] not in TIER_OF:
            state = "serving"
        elif load is None:
            state = "starting" if health is not None else "alive"
        else:
            state = "serving" if load["available"] else "restarting"
        rows.append({**r, "state": state,
                     **{k: (load or {}).get(k) for k in ("running", "waiting", "kv_headroom",
                                                         "draft")}})
    return rows


def format_rows(rows: list[dict]) -> list[str]:
    lines = [f"  {'deployment':14s} {'replica':10s} {'node':15s} {'pid':>7s} {'state':11s} "
             f"{'running':>7s} {'waiting':>7s} {'KV free':>7s} draft"]
    for r in rows:
        kv = "-" if r["kv_headroom"] is None else f"{r['kv_headroom']:.0%}"
        lines.append(f"  {r['deployment']:14s} {r['replica'][:10]:10s} {r['node']:15s} "
                     f"{r['pid'] or '-'!s:>7s} {r['state']:11s} "
                     f"{'-' if r['running'] is None else r['running']!s:>7s} "
                     f"{'-' if r['waiting'] is None else r['waiting']!s:>7s} {kv:>7s} "
                     f"{Path(r['draft']).name if r.get('draft') else '-'}")
    return lines


def fetch_health(url: str) -> tuple[dict | None, str | None]:
    """(the admin `/health`, None) or (None, why not)."""
    import os

    import httpx

    admin = os.environ.get("SPECSERVE_ADMIN_KEY", "")
    try:
        health = httpx.get(url + "/health", timeout=5,
                           headers={"Authorization": f"Bearer {admin}"} if admin else None).json()
    except (httpx.HTTPError, ValueError) as exc:
        return None, f"live load unavailable from {url}/health: {exc}"
    if "tiers" not in health:
        return None, (f"ingress: {health.get('status')} (set $SPECSERVE_ADMIN_KEY for the live "
                      "load)")
    return health, None


def run(args) -> int:
    from cluster.launch.ray_local import enable_token_auth

    enable_token_auth()
    import ray
    from ray import serve

    health, why = fetch_health(args.url)
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
        print("replicas:")
        print("\n".join(format_rows(replica_rows(serve_replicas(args.app), health))))
    finally:
        ray.shutdown()
    if health is None:
        print(why)
        return 0
    print("live load (from the router's stats):")
    for tier, t in health.get("tiers", {}).items():
        tiers = "speculative + baseline" if tier == "target" else "small"
        print(f"  {tier:7s} ({tiers}): {t['replicas']} replica(s) reporting, running {t['running']}, "
              f"waiting {t['waiting']}, KV headroom {t['kv_headroom']:.0%}")
    return 0
