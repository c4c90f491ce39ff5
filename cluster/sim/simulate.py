"""`specserve simulate`: sweep a scenario's loads over the four policies and report.

Owns the sweep, the JSON/markdown/plot outputs, the done-when check (auto against the best of
baseline, speculative at fixed k and always-adaptive at every load) and the article comparison.
Scenario options from the command line: `--mismatch M` (the engines believe speculation costs
(1 + M) x what it does; see cluster/sim/fitted.py) and `--arrivals poisson|bursty` (open loop
at the scenario's `open_loads`). The physics lives in engine/step_cost.py and engine/hardware.py,
the k rule in engine/k_rule.py, the decisions in router/policy.py, the event loop in
cluster/sim/simulator.py, the setups in cluster/sim/scenarios.py.

JSON: {"scenario", "settings", "results": [one row per section, load and policy], "single_user",
"checks", "article"}. Each row carries `draft_placement` and `acceptance_mix` (its section).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from cluster.sim.article import compare_article
from cluster.sim.scenarios import SCENARIOS, Scenario, mix_named
from cluster.sim.replica import build_replicas
from cluster.sim.simulator import POLICIES, simulate
from engine.k_rule import expected_tokens

THROUGHPUT_FLOOR, P95_CEILING = 0.98, 1.02  # auto vs the best fixed policy
FIXED = ("baseline", "speculative", "always-adaptive")  # what auto must match at every load
BURSTY_CV = 3.0  # --arrivals bursty: gaps with coefficient of variation 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", default="seed-4xa100", help="scenario name (see --list)")
    parser.add_argument("--list", action="store_true", help="list scenarios and exit")
    parser.add_argument("--json", type=Path, help="write results as JSON here")
    parser.add_argument("--plot", type=Path, help="write throughput and p95 against load (PNG)")
    parser.add_argument("--markdown", type=Path, help="write the tables as markdown here")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (same seed, same result)")
    parser.add_argument("--quick", action="store_true", help="a few loads only")
    parser.add_argument("--mismatch", type=float, default=None,
                        help="believed-vs-true cost mismatch M: engines price speculation (1 + M) x "
                             "its true cost (fitted step times only; e.g. 0.3 or -0.3)")
    parser.add_argument("--arrivals", choices=("closed", "poisson", "bursty"), default=None,
                        help="closed-loop users, or open loop at the scenario's open_loads "
                             f"(poisson, or bursty: gamma gaps, cv {BURSTY_CV:g})")
    parser.add_argument("--prefix-caching", choices=("on", "off"), default=None,
                        help="the replicas reuse cached prompt prefixes (on: the engine's default; "
                             "what it buys shows on scenarios whose prompts share prefixes, chat-4xa100)")
    from cluster.sim.local import add_arguments as local_arguments

    local_arguments(parser)          # --scenario local-cpu: this machine's profiled family


def run(args: argparse.Namespace) -> int:
    if args.list:
        for s in SCENARIOS.values():
            print(f"{s.name:14s} {s.description}")
        print(f"{'local-cpu':14s} this machine's profiled engines of the served family (cluster/sim/local.py)")
        return 0
    if args.scenario == "local-cpu":
        from cluster.sim.local import run_local

        return run_local(args)
    if args.scenario not in SCENARIOS:
        print(f"specserve simulate: unknown scenario {args.scenario!r}; try --list", file=sys.stderr)
        return 2
    from tqdm import tqdm

    scn = with_options(SCENARIOS[args.scenario], args.mismatch, args.arrivals, args.prefix_caching)
    loads = scn.workload.quick_loads if args.quick else scn.workload.loads
    placements = sorted({s.draft_placement for s in scn.sections}, reverse=True)
    total = len(scn.sections) * len(loads) * len(POLICIES) + len(placements) * len(scn.single_user_mixes) * 3
    started = time.time()
    with tqdm(total=total, desc=scn.name, unit="run", file=sys.stderr) as bar:
        results = sweep(scn, loads, args.seed, bar)
        single = single_user(scn, placements, args.seed, bar)
    report = {
        "scenario": scn.name,
        "settings": settings(scn, args.seed, loads),
        "results": results,
        "single_user": single,
        "checks": check(results, scn.workload.closed_loop),
        "article": compare_article(scn.article, results, single) if scn.article else [],
        "wall_s": round(time.time() - started, 1),
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    text = markdown(report)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    if args.plot:
        plot(report, args.plot)
    print(text)
    return 0 if report["checks"]["pass"] else 1


def with_options(scn: Scenario, mismatch: float | None, arrivals: str | None,
                 prefix_caching: str | None = None) -> Scenario:
    """The scenario with a cost mismatch, another arrival process, prefix caching on or off."""
    if prefix_caching is not None:
        scn = replace(scn, deployment=replace(scn.deployment, prefix_caching=prefix_caching == "on"))
    if mismatch is not None:
        if not -1 < mismatch:
            raise ValueError("--mismatch must be > -1")
        scn = replace(scn, deployment=replace(scn.deployment, cost_mismatch=mismatch))
    if arrivals in ("poisson", "bursty"):
        w = scn.workload
        loads = w.open_loads or w.loads
        scn = replace(scn, workload=replace(w, closed_loop=False, loads=loads, quick_loads=loads[::2],
                                            arrival_cv=BURSTY_CV if arrivals == "bursty" else 1.0),
                      article=())
    return scn


def run_one(scn: Scenario, placement: str, policy: str, workload, mix, load, seed: int):
    target, small = build_replicas(scn.deployment, placement, policy, scn.fixed_k)
    dep = scn.deployment
    return simulate(target, small, policy, workload, mix, load, seed, dep.max_context,
                    small_replicas=dep.small_replicas, gpu_hour_usd=dep.gpu_hour_usd), target


def sweep(scn: Scenario, loads, seed: int, bar) -> list[dict]:
    key = "users" if scn.workload.closed_loop else "qps"
    rows = []
    for section in scn.sections:
        mix = mix_named(section.mix)
        for load in loads:
            for policy in POLICIES:
                run, _ = run_one(scn, section.draft_placement, policy, scn.workload, mix, load, seed)
                rows.append({"policy": policy, key: load, "draft_placement": section.draft_placement,
                             "acceptance_mix": section.mix, **_rounded(run.row())})
                bar.update()
    return rows


def single_user(scn: Scenario, placements: list[str], seed: int, bar) -> list[dict]:
    """Speculative (fixed k) and auto over baseline, one user, per placement and mix."""
    out = []
    closed = replace(scn.workload, closed_loop=True)
    for placement in placements:
        for mix_name in scn.single_user_mixes:
            mix, rows = mix_named(mix_name), {}
            for policy in ("baseline", "speculative", "auto"):
                run, target = run_one(scn, placement, policy, closed, mix, 1, seed)
                rows[policy] = run.row()
                bar.update()
            c = target.cost.draft_s(1, 1, 600) / target.cost.target_s(1, 1, 600)  # auto's replica
            base = rows["baseline"]
            entry = {"draft_placement": placement, "acceptance_mix": mix_name, "k": scn.fixed_k,
                     "draft_to_target_cost": round(c, 4)}
            for policy in ("speculative", "auto"):
                for metric, name in (("throughput_tok_s", "tok_s"), ("decode_tok_s_per_seq", "decode")):
                    entry[f"{policy}_speedup_{name}"] = round(rows[policy][metric] / base[metric], 3)
            if mix.concentration <= 0:  # one acceptance for every request: the closed form applies
                a = next(iter(mix.means.values()))
                entry["analytic_speedup"] = round(expected_tokens(a, scn.fixed_k) / (scn.fixed_k * c + 1), 3)
                entry["analytic_best_k"] = max(range(9), key=lambda k: expected_tokens(a, k) / (k * c + 1))
            out.append(entry)
    return out


def check(rows: list[dict], closed_loop: bool) -> dict:
    """Done when: auto >= 0.98x the best fixed policy's throughput and <= 1.02x the lowest
    fixed policy's p95, every load (fixed: baseline, speculative at k, always-adaptive)."""
    key = "users" if closed_loop else "qps"
    by = {(r["draft_placement"], r["acceptance_mix"], r[key], r["policy"]): r for r in rows}
    loads = []
    for (placement, mix, load, policy), auto in by.items():
        if policy != "auto":
            continue
        fixed = [by[(placement, mix, load, p)] for p in FIXED if (placement, mix, load, p) in by]
        best = max(fixed, key=lambda r: r["throughput_tok_s"])
        thr = auto["throughput_tok_s"] / best["throughput_tok_s"]
        p95 = auto["p95_latency_s"] / min(r["p95_latency_s"] for r in fixed)
        loads.append({"draft_placement": placement, "acceptance_mix": mix, key: load,
                      "throughput_ratio": round(thr, 4), "p95_ratio": round(p95, 4),
                      "best_fixed": best["policy"],
                      "pass": thr >= THROUGHPUT_FLOOR and p95 <= P95_CEILING})
    names = ", ".join(FIXED)
    return {"rule": f"auto throughput >= {THROUGHPUT_FLOOR}x max({names}) and "
                    f"auto p95 <= {P95_CEILING}x min({names}), every load",
            "pass": all(x["pass"] for x in loads), "loads": loads}


def settings(scn: Scenario, seed: int, loads) -> dict:
    return {"description": scn.description, "seed": seed, "loads": list(loads), "fixed_k": scn.fixed_k,
            "deployment": asdict(scn.deployment), "workload": asdict(scn.workload),
            "sections": [asdict(s) for s in scn.sections],
            "mixes": {s.mix: asdict(mix_named(s.mix)) for s in scn.sections},
            "notes": {"acceptance": "per-token acceptance a; rows' acceptance_rate is accepted/drafted",
                      "latency": "end to end (arrival to last token); per_token: (last - first token) "
                                 "/ (output - 1)",
                      "peak_memory_gib": "most loaded GPU of the serving replica (reserved KV)"}}


def markdown(report: dict) -> str:
    rows, key = report["results"], "users" if "users" in report["results"][0] else "qps"
    w, d = report["settings"]["workload"], report["settings"]["deployment"]
    lines = [f"## {report['scenario']}: {report['settings']['description']}", "",
             f"Step times: {d['step_times']}; believed-vs-true cost mismatch {d['cost_mismatch']:+g}; "
             + ("closed-loop users" if w["closed_loop"] else f"open loop, arrival cv {w['arrival_cv']:g}"), ""]
    for section in report["settings"]["sections"]:
        sec = [r for r in rows if r["draft_placement"] == section["draft_placement"]
               and r["acceptance_mix"] == section["mix"]]
        lines += [f"### draft {section['draft_placement']}, acceptance mix {section['mix']}", "",
                  f"| {key} | " + " | ".join(f"{p} tok/s" for p in POLICIES) + " | "
                  + " | ".join(f"{p} p95 s" for p in POLICIES) + " | auto peak GiB | auto reasons |",
                  "|" + "---|" * (2 * len(POLICIES) + 3)]
        for load in sorted({r[key] for r in sec}):
            by = {r["policy"]: r for r in sec if r[key] == load}
            reasons = ", ".join(f"{k} {v}" for k, v in by["auto"]["reasons"].items())
            tok_s = " | ".join(f"{by[p]['throughput_tok_s']:.0f}" for p in POLICIES)
            p95 = " | ".join(f"{by[p]['p95_latency_s']:.1f}" for p in POLICIES)
            lines.append(f"| {load:g} | {tok_s} | {p95} | {by['auto']['peak_memory_gib']:.1f} | {reasons} |")
        lines += ["", f"TTFT p95 s / SLO attainment (TTFT <= {w['slo_ttft_s']:g} s, TPOT <= "
                  f"{w['slo_tpot_s'] * 1e3:g} ms) / goodput tok/s / USD per million output tokens "
                  f"(at {d['gpu_hour_usd']:g} USD per GPU-hour) / preemptions:", "",
                  f"| {key} | " + " | ".join(POLICIES) + " |", "|" + "---|" * (len(POLICIES) + 1)]
        for load in sorted({r[key] for r in sec}):
            by = {r["policy"]: r for r in sec if r[key] == load}
            cells = " | ".join(f"{by[p]['p95_ttft_s']:.2f} / {100 * by[p]['slo_attainment']:.0f}% / "
                               f"{by[p]['goodput_tok_s']:.0f} / {by[p]['usd_per_m_tokens']:.2f} / "
                               f"{by[p]['preemptions']}" for p in POLICIES)
            lines.append(f"| {load:g} | {cells} |")
        lines.append("")
    k = report["settings"]["fixed_k"]
    lines += ["### single user: speed-up over baseline", "",
              f"| draft | mix | c = draft/target step | speculative k={k} (tok/s) | auto (tok/s) "
              f"| analytic k={k} |",
              "|---|---|---|---|---|---|"]
    for s in report["single_user"]:
        lines.append(f"| {s['draft_placement']} | {s['acceptance_mix']} | {s['draft_to_target_cost']:.3f} | "
                     f"{s['speculative_speedup_tok_s']:.2f}x | {s['auto_speedup_tok_s']:.2f}x | "
                     f"{s.get('analytic_speedup', float('nan')):.2f}x |".replace("nanx", "-"))
    checks = report["checks"]
    worst_thr = min(checks["loads"], key=lambda x: x["throughput_ratio"])
    worst_p95 = max(checks["loads"], key=lambda x: x["p95_ratio"])
    lines += ["", f"**Check** ({checks['rule']}): {'PASS' if checks['pass'] else 'FAIL'}; "
              f"worst throughput ratio {worst_thr['throughput_ratio']:.3f} "
              f"({worst_thr['draft_placement']}, {key} {worst_thr[key]}), "
              f"worst p95 ratio {worst_p95['p95_ratio']:.3f} "
              f"({worst_p95['draft_placement']}, {key} {worst_p95[key]})."]
    failed = [x for x in checks["loads"] if not x["pass"]]
    lines += [f"- fails at {x['draft_placement']} {key} {x[key]}: throughput {x['throughput_ratio']}, "
              f"p95 {x['p95_ratio']}" for x in failed]
    if report["article"]:
        lines += ["", "### the article's claims beside ours (each placement judged on its own)", "",
                  "| claim | ours | agrees | rule |",
                  "|---|---|---|---|"]
        for c in report["article"]:
            lines.append(f"| {c['claim']} | `{json.dumps(c['ours'])}` | `{json.dumps(c['agrees'])}` | {c['why']} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, sections = report["results"], report["settings"]["sections"]
    key = "users" if "users" in rows[0] else "qps"
    fig, axes = plt.subplots(len(sections), 2, figsize=(11, 3.6 * len(sections)), squeeze=False)
    for i, section in enumerate(sections):
        sec = [r for r in rows if r["draft_placement"] == section["draft_placement"]
               and r["acceptance_mix"] == section["mix"]]
        for policy in POLICIES:
            pts = sorted((r[key], r["throughput_tok_s"], r["p95_latency_s"])
                         for r in sec if r["policy"] == policy)
            style = dict(marker="o", ms=3, lw=2.2 if policy == "auto" else 1.2, label=policy)
            axes[i][0].plot([p[0] for p in pts], [p[1] for p in pts], **style)
            axes[i][1].plot([p[0] for p in pts], [p[2] for p in pts], **style)
        title = f"{report['scenario']}: draft {section['draft_placement']}, mix {section['mix']}"
        axes[i][0].set(title=title, xlabel=key, ylabel="throughput (output tok/s)")
        axes[i][1].set(title=title, xlabel=key, ylabel="p95 end-to-end latency (s)")
        for ax in axes[i]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rounded(row: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else v) for k, v in row.items()}
