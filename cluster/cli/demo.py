"""`specserve demo`: build the demo family if missing, then generate with target and draft.

Runs the engine in this process (no Ray): the same prompt greedily in baseline and in
speculative mode, printing both texts, whether they are identical, the acceptance and speeds.
"""

from __future__ import annotations

import time


def add_arguments(p) -> None:
    p.add_argument("--family", default=None, help="family folder (default: the demo family)")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k-max", type=int, default=4)


def run(args) -> int:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import RequestOptions, SamplingParams
    from models.demo import ensure_demo_family

    family = args.family or ensure_demo_family()
    engine = LLMEngine(EngineConfig(f"{family}/target", f"{family}/draft"))
    ids = engine.tokenizer(args.prompt)["input_ids"]
    texts = {}
    for mode in ("baseline", "speculative"):
        engine.add_request(mode, ids, SamplingParams(temperature=0, max_tokens=args.max_tokens),
                           RequestOptions(mode, k_max=args.k_max))
        start, text, last = time.perf_counter(), "", None
        while engine.has_unfinished():
            for out in engine.step():
                text, last = text + out.text, out
        dt = time.perf_counter() - start
        texts[mode] = text
        extra = (f", acceptance {last.acceptance_rate:.2f}" if last.acceptance_rate is not None else "")
        print(f"--- {mode}: {last.num_output_tokens} tokens in {dt:.2f} s "
              f"({last.num_output_tokens / dt:.1f} tok/s{extra})\n{args.prompt}{text}")
    print(f"--- greedy outputs identical: {texts['baseline'] == texts['speculative']}")
    return 0
