"""`specserve bench ramp`: a load that rises and falls, against a local cluster whose tiers
autoscale; the replicas per tier follow it (docs/decisions/0032-autoscaling.md).

Starts a local cluster on a model family with `cluster/configs/local-autoscale.yaml` (`make
run`'s config with `autoscaling:` on both tiers), then runs closed-loop users whose number
follows a triangle, 1 -> `--peak` -> 1 over `--minutes`: even users call /v1 (auto), odd users
/economy/v1 (the small tier). Every `--sample-s` it records the users, the RUNNING replicas of
each deployment (Serve's status) and the requests that ended. At the end it reads the usage
ledger and checks that every response that carried an id has its record. Writes the timeline
and the summary as JSON, and a plot of users and replicas per tier against time. On a 2-core
machine throughput does not grow with replicas: what this shows is the behaviour.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

PROMPT = "def fibonacci(n):"
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "local-autoscale.yaml"
DEPLOYMENTS = ("TargetServer", "SmallServer")


def add_arguments(p) -> None:
    p.add_argument("--family", required=True, help="model family folder (target, draft, small)")
    p.add_argument("--config", default=str(CONFIG), help="app YAML with autoscaling tiers")
    p.add_argument("--num-cpus", type=int, default=4, help="Ray's logical CPUs (replicas share "
                   "the cores)")
    p.add_argument("--peak", type=int, default=16, help="users at the top of the ramp")
    p.add_argument("--minutes", type=float, default=10.0, help="the whole ramp, up and down")
    p.add_argument("--settle-s", type=float, default=90.0, help="at one user after the ramp, "
                   "for the tiers to scale back down")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--app", default="specserve", help="Serve application name (the config's)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--plot", default=None, help="write the timeline plot here (PNG)")


def users_at(t: float, duration_s: float, peak: int) -> int:
    """The triangle: 1 user at the start and the end of the ramp, `peak` in its middle, 1
    after it."""
    if t >= duration_s:
        return 1
    return max(1, round(1 + (peak - 1) * (1 - abs(2 * t / duration_s - 1))))


async def _request(client, user: int, model: str, max_tokens: int) -> dict:
    """One completion; never raises."""
    path = "/economy/v1/completions" if user % 2 else "/v1/completions"
    out = {"user": user, "start": time.time(), "status": None, "id": None, "tier": None,
           "retry_after": None}
    try:
        r = await client.post(path, json={"model": model, "prompt": PROMPT, "ignore_eos": True,
                                          "max_tokens": max_tokens, "temperature": 0})
        out.update(status=r.status_code, tier=r.headers.get("x-specserve-tier"),
                   retry_after=r.headers.get("retry-after"))
        if r.status_code == 200:
            out["id"] = r.json().get("id")
    except Exception as exc:            # a connection the server dropped
        out["status"] = f"exception:{type(exc).__name__}"
    out["end"] = time.time()
    return out


async def _ramp(url: str, key: str, model: str, args) -> tuple[list, list, float]:
    import httpx

    from cluster.launch.status import replica_counts

    duration = args.minutes * 60
    start = time.time()
    stop_at = start + duration + args.settle_s
    results: list[dict] = []
    timeline: list[dict] = []

    async def user(i: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300,
                                     headers={"Authorization": f"Bearer {key}"}) as client:
            while time.time() < stop_at:
                if i >= users_at(time.time() - start, duration, args.peak):
                    await asyncio.sleep(0.5)
                    continue
                r = await _request(client, i, model, args.max_tokens)
                results.append(r)
                if r["status"] != 200:
                    await asyncio.sleep(1.0)

    async def sample() -> None:
        while time.time() < stop_at:
            t = time.time() - start
            counts = await asyncio.to_thread(replica_counts, args.app)
            replicas = {d: counts[d] for d in DEPLOYMENTS if d in counts}
            ended = [r for r in results if r["end"] >= start + t - args.sample_s]
            timeline.append({"t_s": round(t, 1), "users": users_at(t, duration, args.peak),
                             "replicas": replicas,
                             "ok_per_s": round(sum(r["status"] == 200 for r in ended)
                                               / args.sample_s, 2)})
            await asyncio.sleep(args.sample_s)

    await asyncio.gather(sample(), *(user(i) for i in range(args.peak)))
    return results, timeline, start


def report(results: list[dict], timeline: list[dict], ledger_ids: set[str]) -> dict:
    statuses = Counter(str(r["status"]) for r in results)
    answered = [r for r in results if r["id"]]
    peak = {d: max((s["replicas"].get(d, 0) for s in timeline), default=0) for d in DEPLOYMENTS}
    last = timeline[-1]["replicas"] if timeline else {}
    return {"requests": len(results), "statuses": dict(statuses),
            "errors_besides_429": sum(n for s, n in statuses.items() if s not in ("200", "429")),
            "429_without_retry_after": sum(r["status"] == 429 and not r["retry_after"]
                                           for r in results),
            "responses_with_id": len(answered),
            "ledger_records_found": sum(r["id"] in ledger_ids for r in answered),
            "tiers_served": dict(Counter(r["tier"] for r in answered)),
            "peak_replicas": peak, "replicas_at_end": last}


def plot(timeline: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] / 60 for s in timeline]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.plot(t, [s["users"] for s in timeline], label="users", color="black")
    top.plot(t, [s["ok_per_s"] for s in timeline], label="requests ok / s", alpha=0.6)
    top.legend()
    top.set_title("specserve bench ramp: load and replicas per tier")
    for d in DEPLOYMENTS:
        bottom.step(t, [s["replicas"].get(d, 0) for s in timeline], where="post", label=d)
    bottom.set_ylabel("running replicas")
    bottom.set_xlabel("minutes")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    import httpx

    from cluster.bench.local import local_cluster, local_config
    from router.ledger import read_records
    from router.store import Database

    cfg, _, _ = local_config(args.family, args.config)
    with local_cluster(args.family, args.config, args.num_cpus) as (url, key, _admin):
        model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                          timeout=30).json()["data"][0]["id"]
        results, timeline, start = asyncio.run(_ramp(url, key, model, args))
        time.sleep(3 * cfg.ledger.drain_period_s + 2)      # the spool's last records drain
        ids = {r.request_id for r in read_records(Database(cfg.ledger.url), since=start - 1)}
    out = report(results, timeline, ids)
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"report": out, "timeline": timeline, "requests": results}, f)
    if args.plot:
        plot(timeline, args.plot)
    ok = (out["errors_besides_429"] == 0 and out["ledger_records_found"] == out["responses_with_id"])
    return 0 if ok else 1
