"""`specserve draft swap DIR` / `specserve draft rollback`: a new draft into the running target.

Guard rails first (here): DIR must be a distilled draft whose report (`distill.json`) shows no
class worse on held-out acceptance than before by more than 0.02 (`--force` overrides). Then each
target replica loads DIR beside its running draft and swaps it in between two engine steps
(`EngineServer.swap_draft`: it refuses another vocabulary, tokenizer or KV shape); requests keep
running. The ingress then restarts its per-class acceptance estimates. Rollback returns each
replica to the draft it ran before.
"""

from __future__ import annotations

import sys
from pathlib import Path

from models.distill_report import guard


def add_arguments(p) -> None:
    if p.prog.endswith("swap"):
        p.add_argument("dir", help="the distilled draft folder (from `specserve draft distill`)")
        p.add_argument("--force", action="store_true", help="swap even if a class got worse")
    p.add_argument("--address", default="auto", help="Ray address (default: %(default)s)")
    p.add_argument("--app", default="specserve", help="Serve application name")


def apply(app: str, path: str | None, rollback: bool) -> list[dict]:
    """Swap every replica of the target deployment; then reset the ingress's estimates."""
    from ray import serve

    status = serve.status().applications[app].deployments["TargetServer"]
    replicas = sum(status.replica_states.values())
    handle = serve.get_deployment_handle("TargetServer", app_name=app)
    done: dict[int, dict] = {}
    for _ in range(20 * max(1, replicas)):       # the handle picks a replica per call
        if len(done) >= replicas:
            break
        if rollback:
            # a replica already rolled back must not roll back twice: swap to the draft
            # the first one rolled back to.
            target = next(iter(done.values()))["draft"] if done else None
            out = handle.swap_draft.remote(target, rollback=target is None).result()
        else:
            out = handle.swap_draft.remote(path).result()
        done.setdefault(out["pid"], out)
    serve.get_deployment_handle("Ingress", app_name=app).draft_swapped.remote().result()
    return list(done.values())


def run(args) -> int:
    rollback = not hasattr(args, "dir")
    path = None
    if not rollback:
        folder = Path(args.dir).expanduser().resolve()
        problems = guard(folder)
        if problems and not args.force:
            print("specserve draft swap: refused (use --force to override):\n  " + "\n  ".join(problems),
                  file=sys.stderr)
            return 1
        path = str(folder)
    from cluster.launch.ray_local import enable_token_auth

    enable_token_auth()
    import ray

    ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
    try:
        results = apply(args.app, path, rollback)
    except Exception as exc:
        from router.wire import find_tier_error

        err = find_tier_error(exc)
        print(f"specserve draft {'rollback' if rollback else 'swap'}: "
              f"{err.message if err else exc}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    for r in results:
        print(f"replica pid {r['pid']}: {r['previous']} -> {r['draft']}")
    return 0
