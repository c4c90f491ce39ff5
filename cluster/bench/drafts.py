"""`specserve draft bench`: the engine's single-stream speculative speed-up per prompt class,
for several drafts of one target side by side in one run.

For each draft an engine is built (target + that draft); each prompt of the chosen classes is
decoded alone in baseline mode and in speculative mode, alternately, at the serving temperature
with the same seed, so a noisy machine hits both alike. Reported per draft and class: tokens/s of
each mode, their ratio (the speed-up) and the engine's measured acceptance rate.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("--target", required=True)
    p.add_argument("--drafts", required=True, help="comma-separated draft folders (label=path allowed)")
    p.add_argument("--prompts", required=True, help="JSONL prompt file (the held-out ones)")
    p.add_argument("--classes", default="", help="comma-separated classes (default: all)")
    p.add_argument("--per-class", type=int, default=6)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--k-max", type=int, default=6)
    p.add_argument("--fixed-k", action="store_true",
                   help="draft k_max every step (no profile, no adaptive k): the drafts compared "
                        "at the same k, whatever a noisy profile would have chosen")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the results here")


def _decode(engine, ids, params, options) -> tuple[int, float]:
    rid = f"r{time.monotonic_ns()}"
    start = time.perf_counter()
    engine.add_request(rid, ids, params, options)
    n = 0
    while engine.has_unfinished():
        for out in engine.step():
            n += len(out.token_ids)
    return n, time.perf_counter() - start


def bench_draft(target: str, draft: str, prompts: list[dict], args) -> dict:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import Mode, RequestOptions, SamplingParams

    engine = LLMEngine(EngineConfig(target=target, draft=draft, num_threads=args.threads,
                                    adaptive_k=not args.fixed_k, profile=not args.fixed_k))
    tok = engine.tokenizer
    result: dict[str, dict] = {}
    for cls in sorted({p["class"] for p in prompts}):
        sums = {"baseline": [0, 0.0], "speculative": [0, 0.0]}
        m0 = engine.metrics.data
        drafted0, accepted0 = m0.num_draft_tokens, m0.num_accepted_tokens
        for i, row in enumerate(p for p in prompts if p["class"] == cls):
            ids = tok(row["prompt"])["input_ids"]
            params = SamplingParams(temperature=args.temperature, max_tokens=args.new_tokens,
                                    seed=1000 + i, ignore_eos=True)
            for mode in ("baseline", "speculative") if i % 2 == 0 else ("speculative", "baseline"):
                n, s = _decode(engine, ids, params, RequestOptions(mode=Mode(mode), k_max=args.k_max))
                sums[mode][0] += n
                sums[mode][1] += s
        m = engine.metrics.data
        drafted, accepted = m.num_draft_tokens - drafted0, m.num_accepted_tokens - accepted0
        tps = {k: v[0] / v[1] for k, v in sums.items()}
        result[cls] = {"baseline_tok_s": round(tps["baseline"], 1),
                       "speculative_tok_s": round(tps["speculative"], 1),
                       "speedup": round(tps["speculative"] / tps["baseline"], 3),
                       "acceptance_rate": round(accepted / drafted, 4) if drafted else None}
    return result


def run(args) -> int:
    from models.distill_prompts import read_prompts

    rows = read_prompts(args.prompts)
    classes = [c for c in args.classes.split(",") if c] or sorted({r["class"] for r in rows})
    prompts = []
    for c in classes:
        prompts += [r for r in rows if r["class"] == c][:args.per_class]
    results = {}
    for spec in args.drafts.split(","):
        label, _, path = spec.rpartition("=")
        label = label or path
        results[label] = bench_draft(args.target, path, prompts, args)
        print(label, json.dumps(results[label]))
    record = {"target": args.target, "temperature": args.temperature, "new_tokens": args.new_tokens,
              "threads": args.threads, "fixed_k": args.fixed_k, "k_max": args.k_max, "per_class": args.per_class, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return 0
