"""`specserve simulate --scenario local-cpu`: the capacity simulator on this machine's own
profile of a served family, to put beside what `specserve bench serve` measures.

The replicas are built from the engines the app would start (the config's tiers, the same
`EngineConfig`, KV budgets and bytes per token), timed by the profiled table the served engines
ran on (`bench serve` records it from `/health?profile=1`; else the engines' own, from their
cache or profiled now) and by what the served target measured of itself in the bench's windows
(`bench_learnt`, batch by batch): what its steps took against that profile's prices, target and
draft parts apart, over every step of a window (`engine.metrics.ServingTimes`; from older JSON,
the calibration's last per-sequence price and draft price factor), the loop's time between
steps, and the serving path's time a request (HTTP, router, Ray: the callers' mean latency less
the engine's). Given a bench JSON (`--bench`), it mirrors that run: its family, app config,
policies, closed-loop users and Poisson rates, and lengths (max_tokens uniform around the mean,
all emitted), and prints predicted against measured. Every policy goes through `choose_tier`
with the plan bench serve selects by endpoint (standard, premium, economy, auto;
always-adaptive asks for speculation on); the engine's adaptive k picks k per step, and each
draft token is accepted with the engine's live per-token acceptance (i.i.d.). `--overhead-ms`
adds a fixed time to every step.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from cluster.sim.served import ByBatch, bench_acceptance, bench_learnt, bench_path, window_level
from engine.calibration import step_cost_from_dict


def add_arguments(parser) -> None:
    a = parser.add_argument
    a("--family", default=None,
      help="local-cpu: the family folder (default: the --bench run's, else the demo family)")
    a("--config", default=None,
      help="local-cpu: the app YAML (default: the --bench run's, else cluster/configs/local.yaml)")
    a("--bench", type=Path, help="local-cpu: a `bench serve` JSON to mirror and compare with")
    a("--users", default=None, help="local-cpu: closed-loop users (default: the --bench run's, else 1,2,4,8,16)")
    a("--rates", default=None, help="local-cpu: Poisson rates, requests/s (default: the --bench run's)")
    a("--policies", default=None, help="local-cpu: bench serve's policy names (default: the --bench run's)")
    a("--acceptance", type=float, default=None,
      help="local-cpu: per-token acceptance (default: the bench JSON's, else 0.7)")
    a("--output-tokens", type=int, default=None,
      help="local-cpu: mean max_tokens (default: the --bench run's, else 64)")
    a("--overhead-ms", type=float, default=0.0,
      help="local-cpu: serving overhead per step added to the profile (ms)")
    a("--profile-only", action="store_true",
      help="local-cpu: time steps by the profile alone, without what the served engine learnt "
           "(its per-sequence overhead and draft price in the bench JSON)")


# measured requests a simulated load runs at least (open loop: bench serve's windows repeated
# until they hold as many): with a few dozen, the p95 moves from one seed to the next by about
# as much as the check's 20% tolerance
SIM_REQUESTS = 2000

# bench serve's policies: (the simulator's policy, the plan bench serve's endpoint selects)
POLICY_OF = {"standard": ("auto", "standard"), "premium": ("auto", "premium"),
             "economy": ("auto", "economy"), "auto": ("auto", "auto"),
             "always-adaptive": ("always-adaptive", "auto")}


REPO_MIX = {"code": 1.0, "prose": 1.0, "chat": 1.0}     # bench serve's default --mix


@dataclass(frozen=True)
class WorkloadShape:
    """A bench run's request lengths as the simulator draws them: lognormal prompts through the
    mix's prompts (each class weighted by its share of requests) and max_tokens uniform around
    the mean, scaled per class as bench serve scales them (cluster/bench/synthetic.py:
    OUTPUT_SCALE). Exact for a mix of one class or of classes alike in length; for classes
    unlike each other it is one distribution through them all (its median and spread, not its
    modes)."""
    mix: dict
    output_median: int
    spread: int
    prompt_median: int = 16
    prompt_sigma: float = 0.3

    @classmethod
    def of(cls, mix: dict, output_tokens: int, output_spread: float) -> "WorkloadShape":
        from cluster.bench.synthetic import OUTPUT_SCALE

        scale = sum(w * OUTPUT_SCALE.get(c, 1.0) for c, w in mix.items()) / sum(mix.values())
        median = max(1, round(output_tokens * scale))
        return cls(dict(mix), median, max(1, round(median * output_spread)))

    def with_prompts(self, lengths: dict[str, list[int]]) -> "WorkloadShape":
        """The prompts' weighted median and log-spread, from each class's token counts."""
        total = sum(self.mix[c] for c, ns in lengths.items() if ns)
        points = sorted((math.log(n), self.mix[c] / total / len(ns))
                        for c, ns in lengths.items() if ns for n in ns)
        mean = sum(x * w for x, w in points)
        sigma = math.sqrt(sum(w * (x - mean) ** 2 for x, w in points))
        cumulative = 0.0
        for x, w in points:
            cumulative += w
            if cumulative >= 0.5:
                break
        return replace(self, prompt_median=round(math.exp(x)), prompt_sigma=sigma)


@dataclass
class _Overhead:
    """A step cost plus a fixed serving overhead per target step."""

    base: object
    fixed_s: float

    def target_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        return self.base.target_s(num_seqs, num_tokens, context_tokens) + self.fixed_s

    def draft_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        return self.base.draft_s(num_seqs, num_tokens, context_tokens)


@dataclass
class _Learnt:
    """The served engine's step times: its profile, plus the per-sequence overhead and the
    draft's price factor it learnt while serving, each as learnt at the step's batch size, and
    the engine loop's time between two steps (`gap_s`; the engine does not calibrate on it)."""

    base: object
    per_seq_ms: ByBatch
    spec_scale: ByBatch
    gap_ms: ByBatch | None = None
    target_factor: ByBatch | None = None   # what the served steps took against the profile's
    draft_factor: ByBatch | None = None    #   prices (ServingTimes); given, they replace the
    #   calibration's readings (per_seq_ms, spec_scale)

    def gap_s(self, num_seqs: int) -> float:
        return self.gap_ms(num_seqs) / 1e3 if self.gap_ms else 0.0

    def target_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        base = self.base.target_s(num_seqs, num_tokens, context_tokens)
        if self.target_factor:
            return self.target_factor(num_seqs) * base
        return base + self.per_seq_ms(num_seqs) / 1e3 * num_seqs

    def draft_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        scale = self.draft_factor or self.spec_scale
        return scale(num_seqs) * self.base.draft_s(num_seqs, num_tokens, context_tokens)


def serving_cost(base, overhead_s: float = 0.0, learnt: dict | None = None):
    """The step times of the served engine: the profile it runs on (`base`, the engine's
    `cost.base`, read from the same cache file the serving replica profiled into), plus what the
    replica learnt while serving (`learnt`: per_seq_ms and spec_scale as `/health` reported
    them, each one number or {batch size: value}; absent: nothing) and a fixed overhead per
    target step."""
    learnt = learnt or {}
    points = lambda v: v if isinstance(v, dict) else {1: v}   # noqa: E731  (one number: every batch)
    given = lambda key: ByBatch(points(learnt[key])) if learnt.get(key) else None   # noqa: E731
    return _Learnt(_Overhead(base, overhead_s) if overhead_s else base,
                   ByBatch(points(learnt.get("per_seq_ms", 0.0))),
                   ByBatch(points(learnt.get("spec_scale", 1.0))),
                   given("gap_ms"), given("target_factor"), given("draft_factor"))


def _replica(engine, overhead_s: float, learnt: dict | None, profile: dict | None = None):
    from cluster.sim.replica import ReplicaConfig

    stats = engine.stats()          # KV budget and bytes per token, as the engine reports them
    # the profile the served engine ran on (the bench JSON's), else this engine's (its cache)
    base = step_cost_from_dict(profile) if profile else engine.cost.base
    return ReplicaConfig(serving_cost(base, overhead_s, learnt), [float(stats.kv_budget_bytes)], [0.0],
                         [stats.target_kv_bytes_per_token], [stats.draft_kv_bytes_per_token],
                         max_num_seqs=engine.config.max_num_seqs,
                         max_batched_tokens=engine.config.max_num_batched_tokens,
                         max_waiting=engine.config.max_waiting,   # then 429
                         engine_downgrade=True,  # the engine's scheduler
                         believed=base)  # what it starts from, and then learns


def build(family: str | None, config: str | None = None, overhead_s: float = 0.0,
          learnt: dict | None = None, profiles: dict | None = None,
          classes: list[str] | None = None, prompts_dir: str | None = None):
    """(target replica, small replica, {class: prompt token counts}, the target's context) from
    the app's config, for bench serve's prompt `classes` (default: the repo's three);
    `profiles` ({tier: step-cost JSON}, what `bench serve` recorded): the tiers' profiled step
    costs, else the engines' own (profiled here, or read from their cache)."""
    from cluster.bench.serve import PROMPTS_DIR, load_prompts
    from cluster.launch.up import DEFAULT_CONFIG
    from engine.llm_engine import LLMEngine
    from router.config import load_config

    # a relative family folder is the caller's (bench serve's --start-local), not the YAML's
    cfg = load_config(config or DEFAULT_CONFIG, Path(family).expanduser().resolve() if family else None)
    engines = [LLMEngine(t.engine_config()) for t in (cfg.target, cfg.small)]
    prompts = load_prompts(prompts_dir or PROMPTS_DIR, classes or list(REPO_MIX))
    lengths = {c: [len(engines[0].tokenizer(p)["input_ids"]) for p in ps] for c, ps in prompts.items()}
    profiles = profiles or {}
    reps = [_replica(engines[0], overhead_s, learnt, profiles.get("target")),
            _replica(engines[1], overhead_s, None, profiles.get("small"))]
    for e in engines:
        e.shutdown() if hasattr(e, "shutdown") else None
    return reps[0], reps[1], lengths, engines[0].max_model_len


def run_local(args) -> int:
    from cluster.bench.serve import _list, _mix
    from cluster.sim.scenarios import AcceptanceMix, Workload
    from cluster.sim.simulator import simulate

    try:
        bench = _read_bench(args.bench)
    except (OSError, ValueError) as exc:
        print(f"specserve simulate: cannot read --bench {args.bench}: {exc}", file=sys.stderr)
        return 2
    given = bench.get("args", {})
    pick = lambda mine, key, default: mine if mine is not None else given.get(key, default)  # noqa: E731
    family, config = pick(args.family, "start_local", None), pick(args.config, "config", None)
    loads = ([("users", u) for u in _list(pick(args.users, "users", "1,2,4,8,16"), int)]
             + [("rate", r) for r in _list(pick(args.rates, "rates", ""), float)])
    policies = _list(pick(args.policies, "policies", ",".join(POLICY_OF)), str)
    unknown = set(policies) - set(POLICY_OF)
    if unknown:
        print(f"specserve simulate: unknown policies {sorted(unknown)}; known: {list(POLICY_OF)}",
              file=sys.stderr)
        return 2
    try:
        mix = _mix(given["mix"]) if given.get("mix") else REPO_MIX
    except ValueError as exc:
        print(f"specserve simulate: the bench's mix: {exc}", file=sys.stderr)
        return 2
    if given.get("shift"):
        print(f"local-cpu: the bench's traffic shifts ({given['shift']}); this simulates its first "
              f"mix throughout", file=sys.stderr)
    shape = WorkloadShape.of(mix, int(pick(args.output_tokens, "output_tokens", 64)),
                             float(given.get("output_spread", 0.5)))
    window_s = float(given.get("duration_s", 60.0))
    # each policy's step times as the engine learnt them in that policy's windows, batch by
    # batch (else the medians over the run)
    pooled = {} if args.profile_only else bench_learnt(bench)
    learnt = {p: pooled if args.profile_only else bench_learnt(bench, p) or pooled for p in policies}
    try:
        target, small, lengths, max_context = build(family, config, args.overhead_ms / 1000,
                                                    pooled, bench.get("served_profiles"),
                                                    list(mix), given.get("prompts"))
    except ValueError as exc:          # e.g. a prompt class with no prompts here
        print(f"specserve simulate: {exc}", file=sys.stderr)
        return 2
    shape = shape.with_prompts(lengths)
    measured = {(r["policy"], r["load_kind"], r["load"]): r for r in bench.get("results", [])}
    a = args.acceptance or bench_acceptance(bench) or 0.7
    mix = AcceptanceMix("local", {"code": 1, "prose": 1, "chat": 1}, {"code": a, "prose": a, "chat": a})
    print(f"local-cpu: acceptance a = {a:.3f}, prompts median {shape.prompt_median} tokens "
          f"(sigma {shape.prompt_sigma:.2f}), outputs {shape.output_median} +- {shape.spread}, "
          f"learnt while serving: {learnt if any(learnt.values()) else 'nothing'}", file=sys.stderr)
    rows = []
    for kind, load in loads:
        for policy in policies:
            sim_policy, plan = POLICY_OF[policy]
            closed = kind == "users"
            w = Workload(closed_loop=closed, prompt_median=shape.prompt_median,
                         prompt_sigma=shape.prompt_sigma, output_median=shape.output_median,
                         max_tokens=shape.output_median + shape.spread,
                         output_spread=shape.spread / shape.output_median,   # bench serve's lengths
                         requests=max(SIM_REQUESTS, 8 * int(load)) if closed else max(1, round(window_s * load)),
                         plan=plan, queue_timeout_s=600,
                         path_s=0.0 if args.profile_only else bench_path(bench, policy, kind, load))
            at = learnt[policy] if args.profile_only else window_level(bench, learnt[policy], policy, kind, load)
            truth = replace(target, cost=serving_cost(target.believed, args.overhead_ms / 1000, at))
            # Open loop, bench serve's window again and again (past saturation its queue is
            # still filling when a window ends: a longer run reads a later, longer queue);
            # closed loop, one long run (it settles within a few requests a user).
            times = 1 if closed else -(-SIM_REQUESTS // w.requests)
            r = pooled_row([simulate(truth, small, sim_policy, w, mix, load, args.seed * 1000 + i,
                                     max_context=max_context) for i in range(times)])
            rows.append(_compared(policy, kind, load, r, measured.get((policy, kind, load))))
    print(table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"scenario": "local-cpu", "acceptance": a, "rows": rows,
                                         "workload": asdict(shape),
                                         "overhead_ms": args.overhead_ms, "learnt": learnt,
                                         "bench": str(args.bench) if args.bench else None}, indent=1))
    return 0


def _read_bench(path: Path | None) -> dict:
    """The `bench serve` JSON to mirror ({} without one); ValueError where it is not one."""
    bench = json.loads(path.read_text()) if path else {}
    if not isinstance(bench, dict) or not isinstance(bench.get("results", []), list):
        raise ValueError("not a `specserve bench serve` JSON")
    profiles = bench.get("served_profiles") or {}
    try:
        for profile in (profiles.values() if isinstance(profiles, dict) else [None]):
            step_cost_from_dict(profile)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"its served_profiles are not step-cost profiles ({exc!r})") from exc
    return bench


def _compared(policy: str, kind: str, load: float, r: dict, m: dict | None) -> dict:
    """One row: the simulated load's `r` (`RunResult.row`) beside the bench's measured window
    `m` (None where the bench did not run that load)."""
    return {"policy": policy, "load_kind": kind, "load": load,
            "predicted_tok_s": r["throughput_tok_s"], "predicted_p95_s": r["p95_latency_s"],
            "measured_tok_s": m["output_tok_s"] if m else None,
            "measured_p95_s": m["e2e_s"]["p95"] if m else None,
            # the parts, to see where a latency differs
            "predicted": {"e2e_p50_s": r["p50_latency_s"], "ttft_p50_s": r["p50_ttft_s"],
                          "tpot_p50_s": r["p50_per_token_s"], "tpot_p95_s": r["p95_per_token_s"],
                          "acceptance_rate": r["acceptance_rate"]},
            "measured": {"e2e_p50_s": m["e2e_s"].get("p50"),
                         "ttft_p50_s": m.get("ttft_s", {}).get("p50"),
                         "tpot_p50_s": m.get("tpot_s", {}).get("p50"),
                         "tpot_p95_s": m.get("tpot_s", {}).get("p95"),
                         "acceptance_rate": m.get("acceptance_rate")} if m else None}


def pooled_row(results: list) -> dict:
    """One row from several simulated runs of a load: their requests and windows together."""
    first = results[0]
    if len(results) == 1:
        return first.row()
    pooled = replace(first, seqs=[s for r in results for s in r.seqs],
                     window_s=sum(r.window_s for r in results),
                     window_tokens=sum(r.window_tokens for r in results),
                     window_requests=sum(r.window_requests for r in results),
                     peak_memory_gib=max(r.peak_memory_gib for r in results))
    return pooled.row()


def table(rows: list[dict]) -> str:
    """Predicted against measured, and how many loads are within 20% on both."""
    fmt = lambda v, f: format(v, f) if v else "-"   # noqa: E731
    lines = ["| load | policy | predicted tok/s | measured tok/s | ratio | predicted p95 s | measured p95 s | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    within = compared = 0
    for r in rows:
        t = r["measured_tok_s"] and r["predicted_tok_s"] / r["measured_tok_s"]
        p = r["measured_p95_s"] and r["predicted_p95_s"] / r["measured_p95_s"]
        if t and p:
            compared += 1
            within += abs(t - 1) <= 0.2 and abs(p - 1) <= 0.2
        lines.append(f"| {r['load_kind']} {r['load']:g} | {r['policy']} | {r['predicted_tok_s']:.1f} | "
                     f"{fmt(r['measured_tok_s'], '.1f')} | {fmt(t, '.2f')} | {r['predicted_p95_s']:.2f} | "
                     f"{fmt(r['measured_p95_s'], '.2f')} | {fmt(p, '.2f')} |")
    if compared:
        lines.append(f"\nwithin 20% on both throughput and p95: {within} of {compared}")
    return "\n".join(lines)
