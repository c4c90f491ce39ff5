"""`specserve bench chat`: multi-turn chat through HTTP, prefix caching on against off.

A shared system prompt, then `--conversations` chats that grow turn by turn: each turn resends
the whole history (system prompt, every earlier user message and the answer text it got) plus a
new user message, streamed on /v1/chat/completions through one policy (`cluster/bench/client.py`;
premium by default, the speculative tier). All conversations send turn t together and wait for
every answer before turn t + 1, so a turn's time to first token compares like with like. One
request with the system prompt alone goes first in every run: a serving app has seen its system
prompt before, and the engine is warm.

With `--start-local FAMILY` the app is deployed with `enable_prefix_caching: false` on its
tiers, run, deployed again with caching on, run, `--repeats` times with the order alternated;
prints TTFT p50 and p90 per turn and output tokens/s of each side, the off/on ratios, and
whether greedy output was the same token for token. With `--url` it runs the app as served (one
side). Owns the conversation script and the on/off comparison; HTTP is `client.py`'s, the
percentiles `stats.py`'s. Why the cache reuses what it does: docs/decisions/0028-prefix-caching.md.
A command of its own, not a `bench serve` prompt mix: its unit is a scripted conversation, not a
window of load, and it compares two deployments of one app, not policies on one deployment.
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


def add_arguments(parser) -> None:
    a = parser.add_argument
    a("--url", default="http://127.0.0.1:8000", help="the running app (default: %(default)s)")
    a("--key", default=os.environ.get("SPECSERVE_API_KEY"), help="API key ($SPECSERVE_API_KEY)")
    a("--start-local", metavar="FAMILY",
      help="start a local cluster serving this family; compare caching on and off")
    a("--config", default=None, help="app YAML for --start-local (default: cluster/configs/local.yaml)")
    a("--num-cpus", type=int, default=None, help="CPUs for Ray with --start-local")
    a("--threads", type=int, default=None, help="torch threads of the target tier (default: the YAML's)")
    a("--policy", default="premium", help="the one policy every request takes (client.py)")
    a("--conversations", type=int, default=8)
    a("--turns", type=int, default=6)
    a("--system-words", type=int, default=600, help="words of the shared system prompt "
      "(the repo's code and prose prompts; the table shows the tokens they make)")
    a("--user-words", type=int, default=30, help="words of code pasted after each user question")
    a("--answer-tokens", type=int, default=48, help="max_tokens of an answer (EOS ignored)")
    a("--repeats", type=int, default=1, help="on/off pairs, order alternated")
    a("--logprobs", action="store_true", help="ask for each answer token's log-probability and "
      "report the largest difference, off against on")
    a("--seed", type=int, default=0)
    a("--timeout-s", type=float, default=300.0, help="HTTP timeout of one request")
    a("--out", default="bench-results/chat", help="output path prefix (.json)")


def script(args, repeat: int = 0) -> tuple[str, list[list[str]]]:
    """(the system prompt, each conversation's user messages by turn), from the repo's prompts;
    another script for each repeat, so no run finds the one before it in the cache."""
    def read(cls):
        return [json.loads(line)["prompt"] for line in
                (PROMPTS_DIR / f"{cls}.jsonl").read_text().splitlines() if line.strip()]

    rng = random.Random(args.seed * 1000 + repeat)
    code, prose = read("code"), read("prose")
    questions = [p.removeprefix("user: ").removesuffix("\nassistant:").strip() for p in read("chat")]
    parts, words = ["You are a careful Python assistant. Follow this guide and reference code."], 0
    while words < args.system_words:
        text = rng.choice(code + prose)
        parts.append(text)
        words += len(text.split())
    users = []
    for _ in range(args.conversations):
        turns = []
        for _ in range(args.turns):
            pasted = " ".join(rng.choice(code).split()[:args.user_words])
            turns.append(f"{rng.choice(questions)}\n\n{pasted}" if pasted else rng.choice(questions))
        users.append(turns)
    return "\n\n".join(parts), users


async def cache_counts(client, admin_key: str | None, at_least: int | None = None,
                       wait_s: float = 15.0, settle_s: float = 1.0) -> tuple[int, int] | None:
    """The target tier's (prefix-cache queries, hits), in prompt tokens, from `/health` (admin
    keys only; None without one), as the replicas report them periodically: once queries reach
    `at_least`, or (None) once they have not changed for `settle_s`, so that requests sent
    before are counted (None if neither within `wait_s`)."""
    if not admin_key:
        return None
    deadline, last, since = time.monotonic() + wait_s, None, time.monotonic()
    while True:
        r = await client.get("/health", headers={"Authorization": f"Bearer {admin_key}"})
        tier = r.json().get("tiers", {}).get("target", {})
        counts = tier.get("prefix_cache_queries", 0), tier.get("prefix_cache_hits", 0)
        if at_least is not None and counts[0] >= at_least:
            return counts
        if counts != last:
            last, since = counts, time.monotonic()
        elif at_least is None and time.monotonic() - since >= settle_s:
            return counts
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(0.25)


async def run_side(client, model: str, system: str, users: list[list[str]], args,
                   admin_key: str | None = None) -> dict:
    """One run of every conversation: per turn the records, the run's wall time, and the prompt
    tokens the target's prefix cache was asked for and found (warm-up included)."""
    from cluster.bench.client import send_chat

    async def ask(messages, label):
        rec = await send_chat(client, args.policy, messages, args.answer_tokens, model, 0.0,
                              ignore_eos=True, label=label, logprobs=args.logprobs)
        if not rec.ok:
            raise RuntimeError(f"{label}: {rec.status} {rec.error}")
        return rec

    before = await cache_counts(client, admin_key)
    warm = await ask([{"role": "system", "content": system}, {"role": "user", "content": "Hello."}],
                     "warm-up")
    histories = [[{"role": "system", "content": system}] for _ in users]
    turns, start = [], time.monotonic()
    for t in range(args.turns):
        for history, msgs in zip(histories, users):
            history.append({"role": "user", "content": msgs[t]})
        recs = await asyncio.gather(*(ask(list(h), f"turn{t + 1}") for h in histories))
        for history, rec in zip(histories, recs):
            history.append({"role": "assistant", "content": rec.text})
        turns.append(recs)
    wall = time.monotonic() - start
    cache = None
    if before is not None:
        sent = warm.prompt_tokens + sum(r.prompt_tokens for recs in turns for r in recs)
        after = await cache_counts(client, admin_key, before[0] + sent)
        if after is not None:
            cache = {"queries": after[0] - before[0], "hits": after[1] - before[1]}
    return {"turns": turns, "wall_s": wall, "prefix_cache": cache}


def summarize(runs: list[dict]) -> dict:
    """Per turn TTFT p50/p90 (over conversations and repeats), prompt tokens, output tokens/s."""
    from cluster.bench.stats import percentile

    turns = []
    for t in range(len(runs[0]["turns"])):
        recs = [r for run in runs for r in run["turns"][t]]
        ttft = [r.ttft for r in recs]
        turns.append({"turn": t + 1, "ttft_p50_s": percentile(ttft, 50),
                      "ttft_p90_s": percentile(ttft, 90),
                      "prompt_tokens_mean": sum(r.prompt_tokens for r in recs) / len(recs)})
    tokens = sum(r.completion_tokens for run in runs for recs in run["turns"] for r in recs)
    wall = sum(run["wall_s"] for run in runs)
    caches = [run["prefix_cache"] for run in runs]
    cache = None
    if all(caches):
        cache = {k: sum(c[k] for c in caches) for k in ("queries", "hits")}
        cache["hit_rate"] = cache["hits"] / cache["queries"] if cache["queries"] else None
    return {"turns": turns, "output_tok_s": tokens / wall, "output_tokens": tokens, "wall_s": wall,
            "prefix_cache": cache}


def _answers(run: dict) -> list[list[list[int]]]:
    return [[r.output_ids for r in recs] for recs in run["turns"]]


def _max_diff(off: list[dict], on: list[dict]) -> float:
    """The largest difference of an answer token's log-probability, off against on."""
    return max((abs(x - y) for a, b in zip(off, on) for ra, rb in zip(a["turns"], b["turns"])
                for p, q in zip(ra, rb) for x, y in zip(p.logprobs, q.logprobs)), default=0.0)


async def bench(url: str, key: str, args, deploy=None, admin_key: str | None = None,
                first: str = "off") -> dict:
    """`deploy(caching)` deploys the app with prefix caching on or off (None: one run as served),
    `first` first (off: an app that served with caching on is left so after one repeat); an
    admin key adds the prefix cache's counts to each side."""
    import httpx

    if first not in ("off", "on"):
        raise ValueError(f"first must be 'off' or 'on', got {first!r}")
    sides = ({first: [], ("on" if first == "off" else "off"): []} if deploy
             else {"served": []})
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout_s,
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        model = None
        for rep in range(args.repeats):
            system, users = script(args, rep)
            order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
            for side in order:
                if deploy:
                    await asyncio.to_thread(deploy, side == "on")
                if model is None:
                    r = (await client.get("/v1/models")).raise_for_status()
                    model = r.json()["data"][0]["id"]
                sides[side].append(await run_side(client, model, system, users, args, admin_key))
                print(f"repeat {rep + 1} caching {side}: {sides[side][-1]['wall_s']:.1f} s",
                      file=sys.stderr)
    report = {"model": model, "url": url, "policy": args.policy,
              "sides": {side: summarize(r) for side, r in sides.items()},
              # greedy: within each repeat the same answers, token for token, on and off
              "answers_equal": (all(_answers(a) == _answers(b)
                                    for a, b in zip(sides["off"], sides["on"])) if deploy else None),
              "logprobs_max_diff": (_max_diff(sides["off"], sides["on"])
                                    if deploy and args.logprobs else None),
              "answers": [_answers(run) for run in next(iter(sides.values()))]}
    if deploy:
        on, off = report["sides"]["on"], report["sides"]["off"]
        report["ratios"] = {
            "ttft_p50_off_over_on": [a["ttft_p50_s"] / b["ttft_p50_s"]
                                     for a, b in zip(off["turns"], on["turns"])],
            "throughput_on_over_off": on["output_tok_s"] / off["output_tok_s"]}
    return report


def table(report: dict) -> str:
    sides = report["sides"]
    names = list(sides)
    head = f"{'turn':>4} {'prompt tok':>10}" + "".join(
        f" {'p50 ' + s + ' ms':>12} {'p90 ' + s + ' ms':>12}" for s in names)
    ratios = report.get("ratios")
    lines = [head + (f" {'off/on p50':>10}" if ratios else "")]
    for t, row in enumerate(sides[names[0]]["turns"]):
        line = f"{row['turn']:>4} {row['prompt_tokens_mean']:>10.0f}"
        for s in names:
            r = sides[s]["turns"][t]
            line += f" {r['ttft_p50_s'] * 1e3:>12.1f} {r['ttft_p90_s'] * 1e3:>12.1f}"
        if ratios:
            line += f" {ratios['ttft_p50_off_over_on'][t]:>10.2f}"
        lines.append(line)
    lines.append("output tokens/s: " + ", ".join(f"{s} {sides[s]['output_tok_s']:.1f}" for s in names)
                 + (f" (on/off {ratios['throughput_on_over_off']:.2f}x)" if ratios else ""))
    for s in names:
        cache = sides[s]["prefix_cache"]
        if cache and cache["hit_rate"] is not None:
            lines.append(f"prefix cache, caching {s}: {cache['hits']} of {cache['queries']} "
                         f"prompt tokens found ({cache['hit_rate']:.1%})")
    if report["answers_equal"] is not None:
        lines.append(f"greedy answers the same with caching on and off: {report['answers_equal']}"
                     + (f"; log-probabilities differ by {report['logprobs_max_diff']:.2g} at most"
                        if report["logprobs_max_diff"] is not None else ""))
    return "\n".join(lines)


def with_caching(cfg, caching: bool, threads: int | None = None):
    """The app config with prefix caching on or off on every tier (and the target's threads)."""
    target = {"enable_prefix_caching": caching} | ({"num_threads": threads} if threads else {})
    update = {"target": cfg.target.model_copy(update=target)}
    if cfg.small is not None:
        update["small"] = cfg.small.model_copy(update={"enable_prefix_caching": caching})
    return cfg.model_copy(update=update)


def run(args) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.start_local:
        from cluster.bench.local import deploy, local_config, local_ray

        cfg, key, admin_key = local_config(args.start_local, args.config)
        with local_ray(args.num_cpus) as url:
            report = asyncio.run(bench(url, key, args, lambda caching: deploy(
                with_caching(cfg, caching, args.threads), url), admin_key))
    elif not args.key:
        print("specserve bench chat: pass --key (or $SPECSERVE_API_KEY) or --start-local",
              file=sys.stderr)
        return 2
    else:
        report = asyncio.run(bench(args.url, args.key, args))
    from_cli = sys.argv[1:3] == ["bench", "chat"]
    report["command"] = "specserve bench chat " + " ".join(sys.argv[3:]) if from_cli else None
    report["args"] = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "key"}
    report["machine"] = describe()
    json_path = out.with_suffix(".json")
    json_path.write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"\nJSON: {json_path}")
    return 1 if report["answers_equal"] is False else 0
