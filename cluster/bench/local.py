"""`specserve bench serve --start-local FAMILY`: a local Ray cluster serving a family, for the
length of a benchmark, as `specserve up` starts one (token auth on, the app from its YAML) but
on a free port, without the dashboard, and with a fresh API key of plan auto (valid for this
cluster only, so no keys file is touched). `bench chat` deploys the app again with other tier
settings on the same cluster (`deploy`)."""

from __future__ import annotations

import contextlib
from pathlib import Path


def local_config(family: str, config: str | None = None):
    """(the app's config for this family with a fresh key of plan auto and admin key added,
    the API key, the admin key)."""
    from cluster.launch.up import DEFAULT_CONFIG
    from router.config import InlineKey, load_config
    from router.keys import hash_key, make_record, new_key

    family_dir = Path(family).expanduser().resolve()
    if not (family_dir / "target").is_dir():
        raise FileNotFoundError(f"{family_dir} has no target/ folder: not a model family")
    cfg = load_config(config or DEFAULT_CONFIG, family_dir)
    key, record = make_record("bench-serve", "auto")
    cfg.auth.keys.append(InlineKey(name=record.name, plan="auto", sha256=record.sha256))
    admin_key = new_key()                 # lets the driver read /health's tier details
    cfg.auth.admin_keys.append(hash_key(admin_key))
    return cfg, key, admin_key


def deploy(cfg, url: str) -> None:
    """Deploy (or deploy again, replacing the replicas) the app; return once it serves."""
    from ray import serve

    from cluster.launch.up import _wait_healthy
    from deployments.app import build_app

    serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.route_prefix, blocking=False)
    _wait_healthy(url)


@contextlib.contextmanager
def local_ray(num_cpus: int | None = None):
    """Yields the API URL of a local Ray cluster (no app yet); tears Serve and Ray down after.
    The cluster serves as `specserve up` does: the API from the ingress replica (direct
    ingress, Serve's proxy beside it) and Ray's workers at niceness 0, so a benchmark measures
    what `make run` serves (docs/decisions/0034-api-from-the-ingress-replica.md)."""
    import os

    from cluster.launch import ray_local
    from models.rendezvous import free_port

    cpus = num_cpus or len(os.sched_getaffinity(0))
    local = ray_local.start(num_cpus=max(2, cpus), http_port=free_port(), dashboard=False,
                            direct_ingress_port=free_port(), worker_niceness=0)
    try:
        yield local.direct_url
    finally:
        ray_local.stop()


@contextlib.contextmanager
def local_cluster(family: str, config: str | None = None, num_cpus: int | None = None):
    """Yields (API URL, API key, admin key) while the app serves; tears Serve and Ray down after."""
    cfg, key, admin_key = local_config(family, config)
    with local_ray(num_cpus) as url:
        deploy(cfg, url)
        yield url, key, admin_key
