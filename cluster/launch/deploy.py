"""`specserve deploy CONFIG`: deploy an app config to a running Ray cluster.

Writes the Serve config that `serve deploy` takes (one application: `import_path:
deployments.app:build_app`, `args:` the validated `AppConfig`) and submits it through the
dashboard's REST API with Ray's auth token (`cluster/launch/ray_local.py`). The code must exist on the
cluster: either specserve is installed on every node (ray_config.yaml's setup_commands do
that), or pass `--working-dir` with a `local://` path on the nodes or a remote URI
(`s3://...zip`, `gs://...zip`, `https://...zip`); a plain local folder is refused, because
`serve deploy` cannot upload one. `--dry-run` prints the Serve config instead.
"""

from __future__ import annotations

import sys

import yaml

REMOTE_SCHEMES = ("local://", "s3://", "gs://", "https://", "http://", "gcs://")


def add_arguments(parser) -> None:
    parser.add_argument("config", help="app YAML (cluster/configs/*.yaml)")
    parser.add_argument("--address", default="http://127.0.0.1:8265",
                        help="the cluster's dashboard address (default: %(default)s)")
    parser.add_argument("--working-dir", default=None,
                        help="runtime_env working_dir: local://PATH on the nodes or a remote URI")
    parser.add_argument("--http-host", default="0.0.0.0")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--dry-run", action="store_true", help="print the Serve config and exit")


def serve_config(cfg, working_dir: str | None, http_host: str, http_port: int) -> dict:
    app = {"name": cfg.name, "route_prefix": cfg.route_prefix,
           "import_path": "deployments.app:build_app", "args": cfg.model_dump(mode="json")}
    if working_dir:
        if not working_dir.startswith(REMOTE_SCHEMES):
            raise ValueError(f"--working-dir {working_dir!r}: serve deploy needs local://PATH "
                             f"(a folder on the cluster nodes) or a remote URI {REMOTE_SCHEMES}")
        app["runtime_env"] = {"working_dir": working_dir}
    return {"proxy_location": "EveryNode", "http_options": {"host": http_host, "port": http_port},
            "applications": [app]}


def run(args) -> int:
    from router.config import load_config

    cfg = load_config(args.config)
    try:
        config = serve_config(cfg, args.working_dir, args.http_host, args.http_port)
    except ValueError as exc:
        print(f"specserve deploy: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(yaml.safe_dump(config, sort_keys=False))
        return 0
    from cluster.launch.ray_local import enable_token_auth

    enable_token_auth()
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    ServeSubmissionClient(args.address).deploy_applications(config)
    print(f"submitted '{cfg.name}' to {args.address}; watch it with `specserve status`")
    return 0
