"""`specserve bench overload`: drive a running cluster past its capacity and check nothing is lost.

First measures capacity: closed-loop clients (`--concurrency`) for `--capacity-s` seconds, the
sustained rate of completed requests. Then offers `--factor` (4) times that rate, open loop
(Poisson arrivals), for `--duration` (60) seconds: a mix of non-streaming and streaming
requests over every pricing endpoint, streams the client drops after the first event, and a
few bad requests. Every request has a client-side deadline; one that neither completed nor
errored by then counts as never ended (must be 0). Reports status counts, the p50/p95 latency
of admitted requests, 5xx other than 503 with Retry-After, the KV in use on every replica after
a short settle (must be 0) and the replica restarts (a replica whose process changed).

Against a running cluster: `--url` and `--key` (and `--address` for the Ray cluster, to read
replica stats). Or `--family DIR` starts a local cluster on that model family (target, draft,
small folders) in this process and tears it down after.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

PREFIXES = ("/v1", "/premium/v1", "/standard/v1", "/economy/v1")
PROMPTS = ("def fibonacci(n):", "class Stack:\n    def", "import os\n", "for i in range(10):")
MIX = {"plain": 0.45, "stream": 0.35, "disconnect": 0.12, "bad": 0.08}


def add_arguments(p) -> None:
    p.add_argument("--url", default=None, help="the app's HTTP address (a running cluster)")
    p.add_argument("--key", default=None, help="an API key whose plan covers every endpoint")
    p.add_argument("--model", default=None, help="model name (default: the first in /v1/models)")
    p.add_argument("--address", default="auto", help="Ray address, to read replica stats")
    p.add_argument("--app", default="specserve", help="Serve application name")
    p.add_argument("--family", default=None, help="start a local cluster on this family instead")
    p.add_argument("--num-cpus", type=int, default=4, help="Ray CPUs of the local cluster")
    p.add_argument("--kv-budget-mb", type=int, default=256, help="KV budget per local replica")
    p.add_argument("--duration", type=float, default=60.0, help="overload seconds")
    p.add_argument("--factor", type=float, default=4.0, help="offered rate / measured capacity")
    p.add_argument("--capacity-s", type=float, default=10.0, help="capacity measurement seconds")
    p.add_argument("--concurrency", type=int, default=16, help="clients when measuring capacity")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--deadline-s", type=float, default=90.0, help="client deadline per request")
    p.add_argument("--settle-s", type=float, default=15.0, help="wait for the KV to drain")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here")


async def _one(client, rng: random.Random, kind: str, model: str, max_tokens: int) -> dict:
    """One request; returns {kind, status, latency_s, retry_after}; never raises."""
    prefix = rng.choice(PREFIXES)
    body = {"model": model, "prompt": rng.choice(PROMPTS),
            "max_tokens": rng.randint(max(1, max_tokens // 4), max_tokens),
            "temperature": rng.choice([0, 0.8])}
    if kind == "bad":
        body[rng.choice(["temperature", "max_tokens", "stream"])] = "yes"
    start = time.monotonic()
    out = {"kind": kind, "status": None, "latency_s": None, "retry_after": False}
    try:
        if kind in ("stream", "disconnect"):
            body["stream"] = True
            async with client.stream("POST", prefix + "/completions", json=body) as r:
                out["status"] = r.status_code
                out["retry_after"] = "retry-after" in r.headers
                if r.status_code == 200:
                    ended = False
                    async for line in r.aiter_lines():
                        if kind == "disconnect" and line.startswith("data: "):
                            out["status"] = "disconnected"
                            return out
                        if line.startswith('data: {"error"'):
                            out["status"] = "stream_error"
                        if line == "data: [DONE]":
                            ended = True
                    if not ended:
                        out["status"] = "stream_cut"
        else:
            r = await client.post(prefix + "/completions", json=body)
            out["status"], out["retry_after"] = r.status_code, "retry-after" in r.headers
        out["latency_s"] = time.monotonic() - start
    except Exception as exc:    # httpx transport errors: the request ended, badly
        out["status"] = f"transport:{type(exc).__name__}"
    return out


async def _bounded(coro, deadline_s: float, kind: str) -> dict:
    try:
        return await asyncio.wait_for(coro, deadline_s)
    except asyncio.TimeoutError:
        return {"kind": kind, "status": "never_ended", "latency_s": None, "retry_after": False}


async def measure_capacity(url: str, key: str, model: str, seconds: float, concurrency: int,
                           max_tokens: int, seed: int) -> float:
    """Completed requests per second with `concurrency` closed-loop clients."""
    import httpx

    rng = random.Random(seed)
    done, stop_at = 0, time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 headers={"Authorization": f"Bearer {key}"},
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker():
            nonlocal done
            while time.monotonic() < stop_at:
                res = await _one(client, rng, "plain", model, max_tokens)
                done += res["status"] == 200
        start = time.monotonic()
        await asyncio.gather(*[worker() for _ in range(concurrency)])
    return done / (time.monotonic() - start)


async def overload(url: str, key: str, model: str, rate: float, seconds: float, max_tokens: int,
                   deadline_s: float, seed: int) -> list[dict]:
    """Poisson arrivals at `rate` for `seconds`; every request ends within `deadline_s`."""
    import httpx

    rng = random.Random(seed + 1)
    kinds, weights = list(MIX), list(MIX.values())
    tasks = []
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(deadline_s),
                                 headers={"Authorization": f"Bearer {key}"},
                                 limits=httpx.Limits(max_connections=2000)) as client:
        stop_at = time.monotonic() + seconds
        while time.monotonic() < stop_at:
            kind = rng.choices(kinds, weights)[0]
            coro = _one(client, random.Random(rng.random()), kind, model, max_tokens)
            tasks.append(asyncio.ensure_future(_bounded(coro, deadline_s, kind)))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


def replica_stats(app: str) -> dict[str, list[dict]]:
    """{deployment: [stats of each replica]}: asks each deployment until every running
    replica (by process id) has answered. Needs this process to be a Ray driver."""
    from ray import serve

    out = {}
    status = serve.status().applications[app]
    for name, dep in status.deployments.items():
        if name == "Ingress":
            continue
        running = sum(n for s, n in dep.replica_states.items()
                      if getattr(s, "value", s) == "RUNNING")
        handle, seen = serve.get_deployment_handle(name, app_name=app), {}
        for _ in range(max(4, 8 * running)):
            stats = handle.stats.remote().result(timeout_s=30)
            seen[stats["pid"]] = stats
            if len(seen) >= running:
                break
        out[name] = list(seen.values())
    return out


def _kv_in_use(stats: dict[str, list[dict]]) -> int:
    return sum(s["stats"]["kv_used_target_bytes"] + s["stats"]["kv_used_draft_bytes"]
               + s["stats"]["num_running"] + s["stats"]["num_waiting"]
               for reps in stats.values() for s in reps)


def settle_kv(app: str, settle_s: float) -> tuple[dict, float]:
    """Replica stats once nothing is in use (or after `settle_s`), and the seconds it took."""
    start = time.monotonic()
    while True:
        stats = replica_stats(app)
        if _kv_in_use(stats) == 0 or time.monotonic() - start > settle_s:
            return stats, time.monotonic() - start
        time.sleep(0.5)


def summarize(results: list[dict], capacity: float, rate: float, seconds: float) -> dict:
    counts: dict[str, int] = {}
    for r in results:
        counts[str(r["status"])] = counts.get(str(r["status"]), 0) + 1
    admitted = sorted(r["latency_s"] for r in results
                      if r["status"] == 200 and r["latency_s"] is not None)

    def pct(q):
        return round(admitted[min(len(admitted) - 1, int(q * len(admitted)))], 3) if admitted else None

    bad_5xx = sum(1 for r in results if isinstance(r["status"], int) and r["status"] >= 500
                  and not (r["status"] == 503 and r["retry_after"]))
    no_retry_429 = sum(1 for r in results if r["status"] == 429 and not r["retry_after"])
    return {"capacity_rps": round(capacity, 2), "offered_rps": round(rate, 2),
            "duration_s": seconds, "requests": len(results), "status_counts": counts,
            "admitted": len(admitted), "p50_admitted_s": pct(0.50), "p95_admitted_s": pct(0.95),
            "never_ended": counts.get("never_ended", 0), "bad_5xx": bad_5xx,
            "429_without_retry_after": no_retry_429,
            # a bad request is a 400 (or a 429/503 when refused before it is read), never a 200
            "bad_requests_not_refused": sum(1 for r in results if r["kind"] == "bad"
                                            and r["status"] not in (400, 429, 503))}


def run_bench(url: str, key: str, model: str, args, app: str | None) -> dict:
    """The whole benchmark against `url`; replica stats when `app` is reachable through Ray."""
    before = replica_stats(app) if app else None
    capacity = asyncio.run(measure_capacity(url, key, model, args.capacity_s, args.concurrency,
                                            args.max_tokens, args.seed))
    rate = max(1.0, args.factor * capacity)
    results = asyncio.run(overload(url, key, model, rate, args.duration, args.max_tokens,
                                   args.deadline_s, args.seed))
    report = summarize(results, capacity, rate, args.duration)
    if app:
        after, took = settle_kv(app, args.settle_s)
        pids = lambda s: {d: {r["pid"] for r in reps} for d, reps in s.items()}  # noqa: E731
        report["kv_in_use_after"] = {d: sum(r["stats"]["kv_used_target_bytes"]
                                            + r["stats"]["kv_used_draft_bytes"] for r in reps)
                                     for d, reps in after.items()}
        report["running_after"] = {d: sum(r["stats"]["num_running"] + r["stats"]["num_waiting"]
                                          for r in reps) for d, reps in after.items()}
        report["kv_settle_s"] = round(took, 2)
        report["replica_restarts"] = {d: len(pids(before)[d] - pids(after).get(d, set()))
                                      for d in pids(before)}
    return report


def print_report(report: dict) -> None:
    print(f"capacity {report['capacity_rps']} req/s; offered {report['offered_rps']} req/s "
          f"for {report['duration_s']:.0f} s: {report['requests']} requests")
    print(f"  {'status':28s} {'count':>7s}")
    for status, n in sorted(report["status_counts"].items()):
        print(f"  {status:28s} {n:7d}")
    rows = [("admitted (200)", report["admitted"]), ("p50 admitted (s)", report["p50_admitted_s"]),
            ("p95 admitted (s)", report["p95_admitted_s"]), ("never ended", report["never_ended"]),
            ("5xx besides 503+Retry-After", report["bad_5xx"]),
            ("429 without Retry-After", report["429_without_retry_after"]),
            ("bad requests not refused", report["bad_requests_not_refused"])]
    for key in ("kv_in_use_after", "running_after", "kv_settle_s", "replica_restarts"):
        if key in report:
            rows.append((key.replace("_", " "), report[key]))
    for name, value in rows:
        print(f"  {name:28s} {value}")


def _local_family_app(family: str, num_cpus: int, kv_budget_mb: int):
    """Start Ray + the app on a family folder; returns (url, key, model, stop)."""
    from pathlib import Path

    from ray import serve

    from cluster.launch import ray_local, up as launch_up
    from models.rendezvous import free_port
    from deployments.app import build_app
    from router.config import AppConfig
    from router.keys import make_record

    root = Path(family).expanduser()
    key, record = make_record("bench-overload", "auto")
    tier = {"kv_budget_bytes": kv_budget_mb << 20, "num_cpus_per_rank": 0.5}
    cfg = {"model_name": "bench", "target": {"model": str(root / "target"),
                                             "draft": str(root / "draft"), **tier},
           "auth": {"keys": [{"name": record.name, "plan": "auto", "sha256": record.sha256}]}}
    if (root / "small").is_dir():
        cfg["small"] = {"model": str(root / "small"), **tier}
    local = ray_local.start(num_cpus=num_cpus, http_port=free_port(), dashboard=False)
    serve.run(build_app(AppConfig.model_validate(cfg)), name="specserve", route_prefix="/")
    launch_up._wait_healthy(local.api_url)
    return local.api_url, key, "bench", ray_local.stop


def run(args) -> int:
    import httpx

    stop = None
    if args.family:
        url, key, model, stop = _local_family_app(args.family, args.num_cpus,
                                                   args.kv_budget_mb)
        app = "specserve"
    else:
        if not (args.url and args.key):
            print("give --url and --key of a running cluster, or --family to start one")
            return 2
        url, key, app = args.url.rstrip("/"), args.key, None
        model = args.model or httpx.get(url + "/v1/models", timeout=10, headers={
            "Authorization": f"Bearer {key}"}).json()["data"][0]["id"]
        try:
            from cluster.launch.ray_local import enable_token_auth

            enable_token_auth()
            import ray

            ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
            app = args.app
        except Exception as exc:
            print(f"no Ray cluster at {args.address} ({exc}): KV and restarts are not reported")
    try:
        report = run_bench(url, key, model, args, app)
    finally:
        if stop:
            stop()
    print_report(report)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    ok = (report["never_ended"] == 0 and report["bad_5xx"] == 0
          and report["bad_requests_not_refused"] == 0
          and not any((report.get("kv_in_use_after") or {}).values()))
    return 0 if ok else 1
