"""What log-probabilities cost the engine (docs/decisions/0025-logprobs.md).

Runs the engine alone on a model family, one thread, greedy: a batch of requests decoding
speculatively (k = 4) without logprobs, with logprobs 0 and with 20 alternatives; then one long
prompt prefilled with and without prompt logprobs. Prints seconds and tokens per second.

    python scripts/logprobs_cost.py /work/shared/models/reference-py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import RequestOptions, SamplingParams  # noqa: E402


def run(engine, prompts, params, mode="speculative") -> tuple[float, int]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params, RequestOptions(mode=mode, k_max=4))
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(o.token_ids) for o in engine.step())
    return time.perf_counter() - start, tokens


def main(family: str, batch: int = 8, new: int = 64, prompt_len: int = 1024) -> None:
    torch.set_num_threads(1)
    target, draft = str(Path(family) / "target"), str(Path(family) / "draft")
    engine = LLMEngine(EngineConfig(target, draft, profile=False, adaptive_k=False, num_threads=1,
                                    kv_budget_bytes=512 << 20))
    prompts = [[5 + i, 17, 33, 9, 12 + i] * 6 for i in range(batch)]
    run(engine, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm up
    for label, n in (("off", None), ("logprobs 0", 0), ("logprobs 20", 20), ("off", None)):
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=n)
        seconds, tokens = min(run(engine, prompts, params) for _ in range(3))
        print(f"decode  batch {batch} speculative k=4 {label:12s} {seconds:6.3f} s  "
              f"{tokens / seconds:7.1f} tok/s")
    long = [[(7 * j) % 500 + 3 for j in range(prompt_len)]]
    for label, n in (("off", None), ("prompt_logprobs 0", 0), ("prompt_logprobs 5", 5)):
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=n,
                                prompt_logprobs=n)
        seconds, _ = min(run(engine, long, params, mode="baseline") for _ in range(3))
        print(f"prefill {prompt_len} tokens {label:18s} {seconds:6.3f} s")


if __name__ == "__main__":
    main(sys.argv[1])
