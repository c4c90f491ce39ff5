"""`specserve bench prefix`: multi-turn chat on one engine, prefix caching on and off side by side.

A shared system prompt, then conversations that grow turn by turn: each turn resends the
history (system prompt, every earlier user message and answer) plus a new user message. All
conversations send turn t together and wait for every answer before turn t + 1, as chat
clients that each wait for their answer. Prints, per turn, the time to first token (p50 over
the conversations) with the cache off and on, and the output tokens per second of each run.
It drives the engine in this process (no HTTP, no Ray): the served path adds the same hops to
both runs. Why the cache and what it reuses: docs/decisions/0028-prefix-caching.md.
"""

from __future__ import annotations

import random
import statistics
import time

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import RequestOptions, SamplingParams


def add_arguments(parser) -> None:
    parser.add_argument("--family", required=True,
                        help="a model family folder with target/ and draft/ (e.g. reference-py)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=400)
    parser.add_argument("--user-tokens", type=int, default=40)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--mode", default="speculative", choices=["speculative", "baseline"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)


def _run(args, caching: bool) -> tuple[list[float], float, float]:
    """(TTFT p50 per turn in seconds, output tokens per second, prefix-cache hit rate)."""
    family = args.family.rstrip("/")
    engine = LLMEngine(EngineConfig(f"{family}/target", f"{family}/draft", profile=False,
                                    num_threads=args.threads, enable_prefix_caching=caching,
                                    kv_budget_bytes=256 << 20, max_num_batched_tokens=512))
    vocab = engine.target_model.vocab_size
    rng = random.Random(args.seed)
    words = lambda n: [rng.randrange(10, vocab) for _ in range(n)]   # noqa: E731
    system = words(args.system_tokens)
    history = [list(system) for _ in range(args.conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    ttft, tokens, start = [], 0, time.perf_counter()
    for turn in range(args.turns):
        sent = {}
        for c in range(args.conversations):
            history[c] += words(args.user_tokens)
            engine.add_request(f"t{turn}c{c}", history[c], params,
                               RequestOptions(mode=args.mode, k_max=4))
            sent[f"t{turn}c{c}"] = time.perf_counter()
        first = {}
        while engine.has_unfinished():
            for out in engine.step():
                c = int(out.request_id.split("c")[1])
                if out.token_ids and out.request_id not in first:
                    first[out.request_id] = time.perf_counter() - sent[out.request_id]
                history[c] += out.token_ids
                tokens += len(out.token_ids)
        ttft.append(statistics.median(first.values()))
    stats = engine.stats()
    return ttft, tokens / (time.perf_counter() - start), stats.prefix_cache_hit_rate or 0.0


def run(args) -> int:
    off = _run(args, caching=False)
    on = _run(args, caching=True)
    print(f"{args.conversations} conversations x {args.turns} turns, system prompt "
          f"{args.system_tokens} tokens, +{args.user_tokens} user / {args.answer_tokens} answer "
          f"tokens a turn, {args.mode}")
    print(f"{'turn':>4} {'TTFT p50 off (ms)':>18} {'on (ms)':>9} {'off/on':>7}")
    for t, (a, b) in enumerate(zip(off[0], on[0]), 1):
        print(f"{t:>4} {a * 1e3:>18.1f} {b * 1e3:>9.1f} {a / b:>7.2f}")
    print(f"throughput (output tokens/s): off {off[1]:.1f}, on {on[1]:.1f} "
          f"({on[1] / off[1]:.2f}x); prefix-cache hit rate on: {on[2]:.1%}")
    return 0
