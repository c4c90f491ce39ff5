"""`specserve bench serve --start-local FAMILY`: a local Ray cluster serving a family, for the
length of a benchmark, as `specserve up` starts one (token auth on, the app from its YAML) but
on a free port, without the dashboard, and with a fresh API key of plan auto (valid for this
cluster only, so no keys file is touched)."""

from __future__ import annotations

import contextlib
from pathlib import Path


@contextlib.contextmanager
def local_cluster(family: str, config: str | None = None, num_cpus: int | None = None):
    """Yields (API URL, API key, admin key) while the app serves; tears Serve and Ray down after."""
    import os

    from ray import serve

    from cluster.launch import ray_local
    from models.rendezvous import free_port
    from cluster.launch.up import DEFAULT_CONFIG, _wait_healthy
    from deployments.app import build_app
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
    cpus = num_cpus or len(os.sched_getaffinity(0))
    local = ray_local.start(num_cpus=max(2, cpus), http_port=free_port(), dashboard=False)
    try:
        serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.route_prefix, blocking=False)
        _wait_healthy(local.api_url)
        yield local.api_url, key, admin_key
    finally:
        ray_local.stop()
