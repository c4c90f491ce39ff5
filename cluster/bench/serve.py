"""`specserve bench serve`: the seed's experiment through HTTP on a running cluster.

Drives the OpenAI API (streamed completions, a real API key, the pricing endpoints) with
closed-loop users and open-loop Poisson arrivals, for each policy (`cluster/bench/client.py`
says how a policy is chosen through the API) and load, `--repeats` times with the policies'
order rotated, each run a warm-up then a measured window. Writes JSON (per-repeat and pooled
numbers, auto against the best fixed policy) and a PNG (`cluster/bench/plot.py`), and prints a
table. `--start-local FAMILY` starts a local Ray cluster with the app first (as `specserve up`
does, with a fresh key of plan auto, which covers every endpoint); else `--url` and `--key`.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

from cluster.bench.machine import describe

PROMPTS_DIR = Path(__file__).parents[1] / "prompts"
FIXED = ("standard", "premium", "always-adaptive")     # the fixed policies auto must match


def add_arguments(parser) -> None:
    a = parser.add_argument
    a("--url", default="http://127.0.0.1:8000", help="the running app (default: %(default)s)")
    a("--key", default=os.environ.get("SPECSERVE_API_KEY"), help="API key of plan auto ($SPECSERVE_API_KEY)")
    a("--admin-key", default=os.environ.get("SPECSERVE_ADMIN_KEY"),
      help="admin key: /health then shows KV and acceptance ($SPECSERVE_ADMIN_KEY)")
    a("--start-local", metavar="FAMILY", help="start a local cluster serving this family folder first")
    a("--config", default=None, help="app YAML for --start-local (default: cluster/configs/local.yaml)")
    a("--num-cpus", type=int, default=None, help="CPUs for Ray with --start-local")
    a("--policies", default="auto,premium,standard,economy,always-adaptive")
    a("--users", default="1,2,4,8,16", help="closed-loop user counts ('' for none)")
    a("--rates", default="", help="open-loop Poisson rates, requests/s ('' for none)")
    a("--think-s", type=float, default=0.0, help="mean think time of a closed-loop user")
    a("--warmup-s", type=float, default=10.0, help="seconds before each measured window")
    a("--duration-s", type=float, default=60.0, help="measured window per run")
    a("--repeats", type=int, default=2, help="runs per (policy, load), order rotated")
    a("--mix", default="code=1,prose=1,chat=1", help="prompt classes and weights; besides the "
      "repo's classes, random (random-word text) and long (long prompts, short answers)")
    a("--shift", default="", help="S:MIX: after S seconds of a run (from its first request) "
      "the prompts come from MIX instead (traffic that drifts, e.g. 600:code=1,random=3)")
    a("--alignment-dir", default="", help="the alignment loop's folder: its records during the "
      "runs go into the report and the timeline plot")
    a("--prompts", default=str(PROMPTS_DIR), help="folder of CLASS.jsonl prompt files")
    a("--output-tokens", type=int, default=64, help="mean max_tokens of a request")
    a("--output-spread", type=float, default=0.5, help="max_tokens uniform in mean*(1 +- spread)")
    a("--temperature", type=float, default=0.0)
    a("--stop-at-eos", action="store_true", help="let EOS end a request (default: ignore_eos)")
    a("--slo-ttft-s", type=float, default=1.0, help="SLO: time to first token")
    a("--slo-tpot-s", type=float, default=0.1, help="SLO: time per output token")
    a("--timeout-s", type=float, default=300.0, help="HTTP timeout of one request")
    a("--seed", type=int, default=0)
    a("--timeline-s", type=float, default=0.0,
      help="also report each run in buckets of this many seconds, per class (0: off)")
    a("--out", default="bench-results/serve", help="output path prefix (.json, .png)")
    a("--no-plot", action="store_true")


def _mix(text: str, flag: str = "--mix") -> dict[str, float]:
    mix = {}
    for part in _list(text, str):
        name, sep, weight = part.partition("=")
        try:
            mix[name.strip()] = float(weight)
        except ValueError:
            sep = ""
        if not sep or not name.strip() or mix[name.strip()] <= 0:
            raise ValueError(f"{flag} takes CLASS=WEIGHT,... with weights above 0, not {text!r}")
    return mix


def read_workload(args) -> tuple[list[str], dict[str, float], tuple[float, dict] | None]:
    """The policies, the prompt mix and the shift (seconds, later mix) the flags ask for; a
    malformed flag is a ValueError that names it, raised before anything starts."""
    from cluster.bench.client import POLICIES

    policies = _list(args.policies, str)
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; known: {list(POLICIES)}")
    shift = None
    if args.shift:
        after, sep, later = args.shift.partition(":")
        try:
            seconds = float(after)
        except ValueError:
            sep = ""
        if not sep or seconds < 0:
            raise ValueError(f"--shift takes SECONDS:CLASS=WEIGHT,..., not {args.shift!r}")
        shift = (seconds, _mix(later, "--shift"))
    return policies, _mix(args.mix), shift


def _list(text: str, cast) -> list:
    return [cast(x) for x in text.split(",") if x.strip()]


def load_prompts(folder: str | Path, classes: list[str]) -> dict[str, list[str]]:
    """Each class's prompts: `folder`/CLASS.jsonl, or a synthetic source (`random`, `long`:
    cluster/bench/synthetic.py)."""
    from cluster.bench.synthetic import SYNTHETIC, long_prompts, random_word_prompts

    out = {}
    for cls in classes:
        if cls == "random":
            out[cls] = random_word_prompts()
        elif cls == "long":
            written = [p for c in ("code", "prose", "chat")
                       for p in load_prompts(PROMPTS_DIR, [c])[c]]
            out[cls] = long_prompts(written)
        else:
            path = Path(folder) / f"{cls}.jsonl"
            if not path.is_file():
                raise ValueError(f"no prompts for class {cls!r}: {path} does not exist (built in: "
                                 f"{', '.join(SYNTHETIC)})")
            out[cls] = [json.loads(line)["prompt"] for line in path.read_text().splitlines()
                        if line.strip()]
    return out


def window_order(policies: list[str], load_index: int, repeat: int) -> list[str]:
    """The policies' windows at one load and repeat, rotated by both: the first window after a
    change of load meets the engine as the last load left it (its learnt prices, its batch),
    so a policy that always came first there would read low. Rotated, each policy opens as
    many loads as the others."""
    shift = (load_index + repeat) % len(policies)
    return policies[shift:] + policies[:shift]


async def run_one(client, policy: str, load: tuple[str, float], workload, model: str, args,
                  rng: random.Random) -> tuple[list, float, float, dict]:
    """One run: warm-up, then the window; returns (records, window start, end, health peaks)."""
    from cluster.bench.client import HealthSampler, closed_loop, poisson, send

    records = []

    async def issue():
        rec = await send(client, policy, workload.draw(), model, args.temperature,
                         not args.stop_at_eos)
        records.append(rec)
        return rec

    sampler = HealthSampler(client, admin_key=args.admin_key)
    sampler.start()
    start = time.monotonic() + args.warmup_s
    end = start + args.duration_s
    kind, value = load
    if kind == "users":
        await closed_loop(issue, int(value), end, args.think_s, rng)
    else:
        await poisson(issue, value, end, rng)
    await sampler.stop()
    return records, start, end, sampler.peaks(start, end)


async def bench(url: str, key: str, args, progress=True) -> dict:
    import httpx
    from tqdm import tqdm

    from cluster.bench.client import Workload, served_profiles
    from cluster.bench.stats import SLO, mean_ci95, summarize, timeline

    policies, mix, shift = read_workload(args)
    prompts = load_prompts(args.prompts, list(mix) + (list(shift[1]) if shift else []))
    loads = [("users", u) for u in _list(args.users, int)] + [("rate", r) for r in _list(args.rates, float)]
    slo = SLO(args.slo_ttft_s, args.slo_tpot_s)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout_s, limits=limits,
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        models = (await client.get("/v1/models")).raise_for_status().json()["data"]
        model = models[0]["id"]
        runs, results = [], []
        bar = tqdm(total=len(loads) * args.repeats * len(policies), unit="run", disable=not progress,
                   desc="bench serve", file=sys.stderr)
        for index, load in enumerate(loads):
            windows = {p: [] for p in policies}
            for rep in range(args.repeats):
                order = window_order(policies, index, rep)
                for policy in order:
                    bar.set_description(f"{load[0]}={load[1]:g} {policy} #{rep + 1}")
                    # the same prompts and lengths for every policy within a repeat
                    workload = Workload(prompts, mix, args.output_tokens, args.output_spread,
                                        seed=args.seed * 1000 + rep, shift=shift)
                    rng = random.Random(args.seed * 1000 + rep + 1)
                    recs, start, end, peaks = await run_one(client, policy, load, workload,
                                                            model, args, rng)
                    summary = summarize([(recs, start, end)], slo)
                    summary.update(policy=policy, load_kind=load[0], load=load[1], repeat=rep,
                                   health_peaks=peaks,
                                   start_unix=time.time() - (time.monotonic() - start))
                    if args.timeline_s > 0:
                        summary["timeline"] = timeline(recs, start, end, args.timeline_s)
                    runs.append(summary)
                    windows[policy].append((recs, start, end))
                    bar.set_postfix(tok_s=f"{summary['output_tok_s']:.1f}",
                                    p95=f"{summary['e2e_s']['p95'] or 0:.2f}s")
                    bar.update()
            for policy in policies:
                pooled = summarize(windows[policy], slo)
                reps = [r for r in runs if r["policy"] == policy and (r["load_kind"], r["load"]) == load]
                pooled.update(policy=policy, load_kind=load[0], load=load[1],
                              repeats={m: mean_ci95([_get(r, m) for r in reps if _get(r, m) is not None])
                                       for m in ("output_tok_s", "e2e_s.p95", "goodput_tok_s",
                                                 "slo_attainment")},
                              health_peaks=_max_peaks([r["health_peaks"] for r in reps]))
                results.append(pooled)
        bar.close()
        profiles = await served_profiles(client, args.admin_key)
    return {"model": model, "url": url, "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
            "results": results, "comparison": compare(results), "runs": runs,
            "served_profiles": profiles}


def _get(d: dict, path: str):
    for part in path.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _max_peaks(peaks: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for p in peaks:
        for kind, values in p.items():
            o = out.setdefault(kind, {})
            for k, v in values.items():
                if k.startswith("peak_") and v is not None:
                    o[k] = max(o.get(k, 0), v)
    return out


def compare(results: list[dict]) -> list[dict]:
    """Per load: auto against the fixed policy with the highest throughput."""
    out = []
    for load in dict.fromkeys((r["load_kind"], r["load"]) for r in results):
        at = {r["policy"]: r for r in results if (r["load_kind"], r["load"]) == load}
        fixed = [at[p] for p in FIXED if p in at]
        if "auto" not in at or not fixed:
            continue
        best = max(fixed, key=lambda r: r["output_tok_s"])
        auto = at["auto"]
        out.append({"load_kind": load[0], "load": load[1], "best_fixed": best["policy"],
                    "throughput_ratio": auto["output_tok_s"] / best["output_tok_s"],
                    "p95_ratio": (auto["e2e_s"]["p95"] / best["e2e_s"]["p95"]
                                  if auto["e2e_s"]["p95"] and best["e2e_s"]["p95"] else None)})
    return out


def run(args) -> int:
    try:
        read_workload(args)
    except ValueError as exc:
        print(f"specserve bench serve: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.start_local:
        from cluster.bench.local import local_cluster

        with local_cluster(args.start_local, args.config, args.num_cpus) as (url, key, admin_key):
            args.admin_key = admin_key
            report = asyncio.run(bench(url, key, args))
    else:
        if not args.key:
            print("specserve bench serve: pass --key (or $SPECSERVE_API_KEY) or --start-local",
                  file=sys.stderr)
            return 2
        report = asyncio.run(bench(args.url, args.key, args))
    from_cli = sys.argv[1:3] == ["bench", "serve"]
    report["command"] = "specserve bench serve " + " ".join(sys.argv[3:]) if from_cli else None
    report["args"] = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("key", "admin_key")}
    report["machine"] = describe()
    if args.alignment_dir:
        from deployments.alignment_loop import read_history

        first = min((r["start_unix"] for r in report["runs"]), default=0.0)
        report["alignment_history"] = [r for r in read_history(args.alignment_dir)
                                       if r["time"] >= first - args.warmup_s]
    json_path = out.with_suffix(".json")
    json_path.write_text(json.dumps(report, indent=1))
    from cluster.bench.plot import plot, table

    print(table(report))
    print(f"\nJSON: {json_path}")
    if not args.no_plot:
        print(f"PNG:  {plot(report, out.with_suffix('.png'))}")
        if any(r.get("timeline") for r in report["runs"]):
            from cluster.bench.plot import plot_timeline

            print(f"PNG:  {plot_timeline(report, out.with_name(out.name + '-timeline.png'))}")
    errors = {s for r in report["results"] for s in r["errors_by_status"] if s != "429"}
    return 1 if errors else 0
