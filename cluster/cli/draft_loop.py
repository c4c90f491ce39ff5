"""`specserve draft history` and `specserve draft canary DIR`: the alignment loop's record, and
an operator's draft canaried by it (deployments/alignment_loop.py).

`history` reads `alignment.dir/history.jsonl` (from `--config`, or `--dir`): one line per
record, with its round, event, reason, class and figures. `canary` asks the running loop to
canary DIR (the swap guard first, as `draft swap`; `--force` skips it): promoted or rolled back
by the loop's rules, with no further command.
"""

from __future__ import annotations

import json
import sys
import time


def add_arguments(p) -> None:
    if p.prog.endswith("canary"):
        p.add_argument("dir", help="the draft folder to canary")
        p.add_argument("--force", action="store_true", help="skip the swap guard")
        p.add_argument("--address", default="auto", help="Ray address (default: %(default)s)")
        p.add_argument("--app", default="specserve", help="Serve application name")
        return
    where = p.add_mutually_exclusive_group()
    where.add_argument("--config", help="the app config (its alignment.dir)")
    where.add_argument("--dir", help="the alignment folder (default: the config's default)")
    p.add_argument("--json", action="store_true", help="the records as JSON lines")


def summary(rec: dict) -> str:
    """A record's figures in a few words."""
    parts = []
    for key in ("prompt_class", "draft", "returncode", "seconds"):
        if rec.get(key) is not None:
            parts.append(f"{key}={rec[key]}")
    if rec.get("heldout_delta"):
        parts.append("heldout " + " ".join(f"{c}:{d:+.3f}" if isinstance(d, (int, float))
                                          else f"{c}:{d}" for c, d in rec["heldout_delta"].items()))
    for side in ("canary", "rest", "live"):
        if rec.get(side):
            parts.append(side + " " + " ".join(f"{c}:{f['acceptance']:.3f}/{f['requests']}"
                                              for c, f in rec[side].items()))
    if rec.get("problems"):
        parts.append("; ".join(rec["problems"]))
    return "  ".join(parts)


def history(args) -> int:
    from deployments.alignment_loop import read_history
    from router.alignment_config import AlignmentSection

    folder = args.dir
    if folder is None:
        if args.config:
            from router.config import load_config

            folder = load_config(args.config).alignment.dir
        else:
            folder = AlignmentSection().dir
    records = read_history(folder)
    if args.json:
        for rec in records:
            print(json.dumps(rec))
        return 0
    if not records:
        print(f"no alignment records in {folder}")
        return 0
    for rec in records:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec["time"]))
        print(f"{when}  round {rec['round']:>3}  {rec['event']:<8} {rec.get('reason', ''):<24} "
              f"{summary(rec)}")
    return 0


def canary(args) -> int:
    from pathlib import Path

    from cluster.launch.ray_local import enable_token_auth

    enable_token_auth()
    import ray
    from ray import serve

    ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
    try:
        handle = serve.get_deployment_handle("AlignmentLoop", app_name=args.app)
        status = handle.canary.remote(str(Path(args.dir).expanduser().resolve()),
                                      args.force).result()
    except Exception as exc:
        from router.wire import find_tier_error

        err = find_tier_error(exc)
        print(f"specserve draft canary: {err.message if err else exc}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    print(f"canary of {status['candidate']} started (round {status['round']}); "
          "`specserve draft history` follows it")
    return 0


def run(args) -> int:
    return canary(args) if hasattr(args, "force") else history(args)
