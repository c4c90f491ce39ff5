"""`specserve simulate --scenario local-cpu`: the capacity simulator on this machine's own
profile of a served family, to put beside what `specserve bench serve` measures.

The replicas are built from the engines the app would start (the config's tiers, the same
`EngineConfig`), so the step costs are the profiled table each engine reads from its cache
(`engine/profiler.py`, the same file the serving replica used), the KV budgets and bytes per
token are the engine's, and the workload mirrors bench serve's defaults (the shipped prompts'
token counts, max_tokens uniform around a mean, closed-loop users, no think time). Every policy
goes through `choose_tier` with the plan bench serve selects by endpoint (standard, premium,
economy, auto); the engine's adaptive k picks k per step. What it leaves out: HTTP, Ray and
Python overhead between steps, and the other processes sharing the cores; the comparison
with a bench JSON (`--bench`) shows how much that matters.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from engine.cost_model import LinearCost
from router.policy import PLANS


def add_arguments(parser) -> None:
    parser.add_argument("--family", default=None, help="local-cpu: the family folder (default: the demo family)")
    parser.add_argument("--bench", type=Path, help="local-cpu: a `bench serve` JSON to compare with")
    parser.add_argument("--users", default="1,2,4,8,16", help="local-cpu: closed-loop users")
    parser.add_argument("--acceptance", type=float, default=None,
                        help="local-cpu: per-token acceptance (default: the bench JSON's, else 0.7)")
    parser.add_argument("--output-tokens", type=int, default=64, help="local-cpu: mean max_tokens")
    parser.add_argument("--overhead-ms", type=float, default=0.0,
                        help="local-cpu: serving overhead per step added to the profile (ms)")


def robust_fit(samples):
    """A LinearCost through profile samples taken on a shared machine: contention only ever
    slows a timing, so points far above the fit are dropped (three passes) before the last fit."""
    keep = list(samples)
    fit = fit_linear(keep)
    for _ in range(3):
        kept = [s for s in keep if s[3] <= 1.5 * fit(s[0], s[1], s[2])]
        if len(kept) < 4 or len(kept) == len(keep):
            break
        keep, fit = kept, fit_linear(kept)
    return fit


def fit_linear(samples) -> "LinearCost":
    """Non-negative least squares on (num_seqs, num_tokens, context_tokens, seconds) samples.

    Lawson-Hanson style active set on the 4x4 normal equations: solve, drop the most negative
    coefficient, solve again. Columns that never vary (e.g. all context 0) get coefficient 0.
    """
    if not samples:
        raise ValueError("fit_linear needs at least one sample")
    rows = [(1.0, float(n), float(t), float(c)) for n, t, c, _ in samples]
    ys = [float(s) for *_, s in samples]
    active = [j for j in range(4) if j == 0 or any(r[j] != 0.0 for r in rows)]
    coef = [0.0] * 4
    while active:
        sol = _lstsq([[r[j] for j in active] for r in rows], ys)
        if sol is None:          # collinear columns (e.g. num_tokens == num_seqs): drop one
            active.pop()
            continue
        if min(sol) >= 0.0:
            break
        active.pop(min(range(len(sol)), key=sol.__getitem__))
    for j, v in zip(active, sol or []):
        coef[j] = max(0.0, v)
    return LinearCost(*coef)


def _lstsq(x: list[list[float]], y: list[float]) -> list[float] | None:
    """Least squares by the normal equations and Gaussian elimination; None if singular."""
    m = len(x[0])
    a = [[sum(r[i] * r[j] for r in x) for j in range(m)] + [sum(r[i] * v for r, v in zip(x, y))]
         for i in range(m)]
    for col in range(m):
        piv = max(range(col, m), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-300:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(m):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [v - f * w for v, w in zip(a[r], a[col])]
    return [a[i][m] / a[i][i] for i in range(m)]


def fitted_cost(engine, overhead_s: float):
    """The engine's profile samples (its cache file) fitted as fixed + per-sequence + per-token."""
    from dataclasses import replace

    from engine.cost_model import LinearStepCost
    from engine.profiler import _cache_dir, _key

    data = json.loads((_cache_dir(engine) / f"{_key(engine)}.json").read_text())
    target = robust_fit(data["target_samples"])
    target = replace(target, fixed_s=target.fixed_s + overhead_s)
    draft = robust_fit(data["draft_samples"]) if data.get("draft_samples") else None
    return LinearStepCost(target, draft)


def _replica(engine, overhead_s: float):
    from cluster.sim.replica import ReplicaConfig

    stats = engine.stats()          # KV budget and bytes per token, as the engine reports them
    return ReplicaConfig(fitted_cost(engine, overhead_s), [float(stats.kv_budget_bytes)], [0.0],
                         [stats.target_kv_bytes_per_token], [stats.draft_kv_bytes_per_token],
                         max_num_seqs=engine.config.max_num_seqs,
                         max_batched_tokens=engine.config.max_num_batched_tokens,
                         engine_downgrade=True)  # the engine's scheduler


def build(family: str | None, overhead_s: float = 0.0):
    """(target replica, small replica, prompt token counts) from the app's local config."""
    from cluster.bench.serve import PROMPTS_DIR, load_prompts
    from cluster.launch.up import DEFAULT_CONFIG
    from engine.llm_engine import LLMEngine
    from router.config import load_config

    cfg = load_config(DEFAULT_CONFIG, family)
    engines = [LLMEngine(t.engine_config()) for t in (cfg.target, cfg.small)]
    prompts = [p for ps in load_prompts(PROMPTS_DIR, ["code", "prose", "chat"]).values() for p in ps]
    lengths = [len(engines[0].tokenizer(p)["input_ids"]) for p in prompts]
    reps = [_replica(e, overhead_s) for e in engines]
    for e in engines:
        e.shutdown() if hasattr(e, "shutdown") else None
    return reps[0], reps[1], lengths


def _bench_rows(path: Path | None) -> dict:
    if not path:
        return {}
    data = json.loads(path.read_text())
    return {(r["policy"], r["load"]): r for r in data["results"] if r["load_kind"] == "users"}


def _bench_acceptance(path: Path | None) -> float | None:
    """The target's live per-token acceptance that /health reported in the premium runs."""
    if not path:
        return None
    runs = json.loads(path.read_text()).get("runs", [])
    values = [r["health_peaks"].get("target", {}).get("mean_token_acceptance")
              for r in runs if r["policy"] == "premium"]
    values = [v for v in values if v]
    return statistics.median(values) if values else None


def run_local(args) -> int:
    from cluster.sim.scenarios import AcceptanceMix, Workload
    from cluster.sim.simulator import simulate

    target, small, lengths = build(args.family, args.overhead_ms / 1000)
    bench = _bench_rows(args.bench)
    a = args.acceptance or _bench_acceptance(args.bench) or 0.7
    mix = AcceptanceMix("local", {"code": 1, "prose": 1, "chat": 1}, {"code": a, "prose": a, "chat": a})
    users = [int(u) for u in args.users.split(",") if u]
    spread = max(1, args.output_tokens // 2)
    rows = []
    print(f"local-cpu: acceptance a = {a:.3f}, prompts median {statistics.median(lengths)} tokens",
          file=sys.stderr)
    for u in users:
        for plan in PLANS:
            policy = plan           # bench serve names its policies after the plans
            w = Workload(closed_loop=True, loads=tuple(users), prompt_median=int(statistics.median(lengths)),
                         prompt_sigma=0.3, output_median=args.output_tokens, output_sigma=0.3,
                         max_tokens=args.output_tokens + spread, requests=max(60, 8 * u), plan=plan,
                         queue_timeout_s=600)
            policy_name = "auto"      # every plan goes through choose_tier (the ingress's path)
            r = simulate(target, small, policy_name, w, mix, u, args.seed, max_context=512).row()
            m = bench.get((policy, u))
            rows.append({"policy": policy, "users": u, "predicted_tok_s": r["throughput_tok_s"],
                         "predicted_p95_s": r["p95_latency_s"],
                         "measured_tok_s": m["output_tok_s"] if m else None,
                         "measured_p95_s": m["e2e_s"]["p95"] if m else None})
    print("| users | policy | predicted tok/s | measured tok/s | ratio | predicted p95 s | measured p95 s | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["measured_tok_s"] and r["predicted_tok_s"] / r["measured_tok_s"]
        p = r["measured_p95_s"] and r["predicted_p95_s"] / r["measured_p95_s"]
        fmt = lambda v, f: format(v, f) if v else "-"   # noqa: E731
        print(f"| {r['users']} | {r['policy']} | {r['predicted_tok_s']:.1f} | {fmt(r['measured_tok_s'], '.1f')} | "
              f"{fmt(t, '.2f')} | {r['predicted_p95_s']:.2f} | {fmt(r['measured_p95_s'], '.2f')} | {fmt(p, '.2f')} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"scenario": "local-cpu", "acceptance": a, "rows": rows,
                                         "overhead_ms": args.overhead_ms,
                                         "target_cost": vars(target.cost.target),
                                         "draft_cost": vars(target.cost.draft)}, indent=1))
    return 0
