"""`specserve bench failover`: kill the target's engine process under load and time the recovery.

Starts a local cluster on a model family with `make run`'s config (`cluster/configs/local.yaml`),
runs closed-loop streaming users for `--kill-after-s`, then kills the target replica's engine
process (SIGKILL, as the out-of-memory killer would) and goes on for `--after-s`. Half the users
call /premium/v1 (speculative only), half /v1 with `allow_downgrade` (the small tier may serve
them). Reports, from the kill: when the target tier served again (the first request sent after
the kill that the target completed), what the small tier served meanwhile (`tier_down`), every
refusal's status and whether it carried Retry-After, the streams in flight that ended with an
error event, and whether the replica process stayed (an in-place restart) or was replaced
(docs/decisions/0031-engine-restart-in-place.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter

PROMPT = "def fibonacci(n):"


def add_arguments(p) -> None:
    p.add_argument("--family", required=True, help="model family folder (target, draft, small)")
    p.add_argument("--config", default=None, help="app YAML (default: cluster/configs/local.yaml)")
    p.add_argument("--num-cpus", type=int, default=None, help="Ray CPUs of the local cluster")
    p.add_argument("--users", type=int, default=6, help="closed-loop streaming users")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kill-after-s", type=float, default=10.0)
    p.add_argument("--after-s", type=float, default=40.0, help="load after the kill")
    p.add_argument("--app", default="specserve", help="Serve application name (the config's)")
    p.add_argument("--json", default=None, help="write the report here")


async def _request(client, user: int, model: str, max_tokens: int) -> dict:
    """One streamed completion; never raises. Premium for even users, auto + downgrade else."""
    path = "/premium/v1/completions" if user % 2 == 0 else "/v1/completions"
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "allow_downgrade": user % 2 == 1}
    out = {"user": user, "start": time.time(), "status": None, "tier": None, "reason": None,
           "retry_after": None, "stream_error": False}
    try:
        async with client.stream("POST", path, json=body) as r:
            out["status"] = r.status_code
            out["tier"] = r.headers.get("x-specserve-tier")
            out["reason"] = r.headers.get("x-specserve-reason")
            out["retry_after"] = r.headers.get("retry-after")
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"error"' in line[:20]:
                    out["stream_error"] = True
    except Exception as exc:            # a connection the server dropped
        out["status"] = f"exception:{type(exc).__name__}"
    out["end"] = time.time()
    return out


async def _load(url: str, key: str, model: str, args, kill) -> tuple[list, float]:
    import httpx

    stop_at = time.time() + args.kill_after_s + args.after_s
    results: list[dict] = []

    async def user(i: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120,
                                     headers={"Authorization": f"Bearer {key}"}) as client:
            while time.time() < stop_at:
                r = await _request(client, i, model, args.max_tokens)
                results.append(r)
                if r["status"] != 200:
                    await asyncio.sleep(0.2)      # a client that retries at once, nearly

    tasks = [asyncio.create_task(user(i)) for i in range(args.users)]
    await asyncio.sleep(args.kill_after_s)
    killed_at = await asyncio.to_thread(kill)
    await asyncio.gather(*tasks)
    return results, killed_at


def report(results: list[dict], killed_at: float, replica_kept: bool) -> dict:
    after = [r for r in results if r["start"] >= killed_at]
    target_ok = [r for r in after if r["status"] == 200 and r["tier"] != "small"
                 and not r["stream_error"]]
    back = min((r["end"] for r in target_ok), default=None)
    refused = [r for r in after if r["status"] != 200]
    outage = [r for r in after if back is None or r["start"] < back]
    return {
        "target_serves_again_s": None if back is None else round(back - killed_at, 2),
        "in_flight_at_kill": sum(r["start"] < killed_at < r["end"] for r in results),
        "in_flight_ended_with_error_event": sum(r["start"] < killed_at < r["end"]
                                                and r["stream_error"] for r in results),
        "served_by_small_meanwhile": sum(r["status"] == 200 and r["reason"] == "tier_down"
                                         for r in outage),
        "refused": dict(Counter(str(r["status"]) for r in refused)),
        "refused_without_retry_after": sum(r["status"] in (429, 503) and not r["retry_after"]
                                           for r in refused),
        "requests": len(results), "replica_restarted_in_place": replica_kept}


def run(args) -> int:
    import httpx
    from ray import serve

    from cluster.bench.local import local_cluster

    with local_cluster(args.family, args.config, args.num_cpus) as (url, key, _admin):
        model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                          timeout=30).json()["data"][0]["id"]
        target = serve.get_deployment_handle("TargetServer", app_name=args.app)
        before = target.stats.remote().result(timeout_s=60)

        def kill() -> float:
            os.kill(before["engine_pid"], signal.SIGKILL)
            return time.time()

        results, killed_at = asyncio.run(_load(url, key, model, args, kill))
        seen = {}                     # the replicas the handle reaches (any, with several)
        for _ in range(12):
            stats = target.stats.remote().result(timeout_s=60)
            seen[stats["pid"]] = stats
    kept = before["pid"] in seen and seen[before["pid"]]["engine_pid"] != before["engine_pid"]
    out = report(results, killed_at, kept)
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"report": out, "requests": results}, f)
    return 0 if out["target_serves_again_s"] is not None else 1
