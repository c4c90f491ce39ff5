"""`specserve bench sampler`: how often the draft is accepted under the coupled sampler (seeded
requests) next to rejection sampling (unseeded), at the temperatures asked.

Two measurements, both on held-out code (prompts cut as `bench engine` cuts them):
- **teacher-forced**: the target and the draft read the same windows; at every position, with
  p and q after temperature, rejection sampling accepts with sum(min(p, q)) (exact), and the
  coupling with P(argmax(log p + g) = argmax(log q + g)), estimated over `--noise-samples` seeds of
  the engine's own noise (`engine/coupled_sampler.py`). Per-token acceptance, no k involved.
- **in generation**: the engine decodes the prompts at fixed k, once with seeded requests
  (coupled) and once unseeded (rejection); per-token acceptance a = accepted / (accepted +
  rejections) from the engine's counters, and the mean acceptance length.
No timing, so no bench lock is needed; threads at most 2. Imports no Ray.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def add_arguments(p) -> None:
    p.add_argument("--family", required=True, help="folder with target/ and draft/")
    p.add_argument("--json", required=True, help="where to write the results")
    p.add_argument("--temperatures", default="0.7,1.0")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--windows", type=int, default=8, help="teacher-forced windows")
    p.add_argument("--window-tokens", type=int, default=256)
    p.add_argument("--noise-samples", type=int, default=32, help="seeds per position (coupled)")
    p.add_argument("--prompts", type=int, default=8, help="prompts decoded in generation")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="fixed k in generation")


@torch.no_grad()
def teacher_forced(models: tuple, windows: list[list[int]], temperature: float, samples: int) -> dict:
    """models: the target's and the draft's transformers modules (their full distributions)."""
    from engine.coupled_sampler import coupled_sample
    from engine.sampler import RowParams, probabilities
    from engine.sampling_params import SamplingParams

    rejection, coupled, positions = 0.0, 0.0, 0
    for ids in windows:
        x = torch.tensor([ids])
        n = len(ids)
        params = RowParams.build([SamplingParams(temperature=temperature)] * n, [None] * n, "cpu")
        p = probabilities(models[0](x).logits[0].float(), params)
        q = probabilities(models[1](x).logits[0].float(), params)
        rejection += torch.minimum(p, q).sum(-1).sum().item()
        for s in range(samples):
            seeds, pos = [1000 + s] * n, list(range(n))
            agree = coupled_sample(p, seeds, pos) == coupled_sample(q, seeds, pos)
            coupled += agree.double().sum().item() / samples
        positions += n
    return {"positions": positions, "rejection": rejection / positions,
            "coupled": coupled / positions}


def in_generation(engine, prompts: list[list[int]], temperature: float, k: int, new_tokens: int,
                  seeded: bool) -> dict:
    from engine.sampling_params import RequestOptions, SamplingParams

    before = engine.snapshot()
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True,
                                seed=(7 + i) if seeded else None)
        engine.add_request(f"{'s' if seeded else 'u'}{temperature}-{i}", p, params,
                           RequestOptions(mode="speculative", k_max=k))
    while engine.has_unfinished():
        engine.step()
    after = engine.snapshot()
    drafts = after.num_drafts - before.num_drafts
    per_pos = [a - b for a, b in zip(after.num_accepted_tokens_per_pos,
                                     before.num_accepted_tokens_per_pos + [0] * k)]
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    rejections = drafts - per_pos[k - 1]         # steps that did not accept all k (fixed k)
    return {"drafts": drafts, "accepted": accepted,
            "token_acceptance": accepted / max(1, accepted + rejections),
            "acceptance_rate": accepted / max(1, drafts * k),
            "mean_acceptance_length": 1 + accepted / max(1, drafts)}


def run(args) -> int:
    from cluster.bench.engine import _prompts
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from models.loader import load_model

    torch.set_num_threads(min(2, args.threads))
    fam = Path(args.family)
    engine = LLMEngine(EngineConfig(str(fam / "target"), str(fam / "draft"), num_threads=args.threads,
                                    kv_budget_bytes=1 << 28, adaptive_k=False, profile=False))
    tok = engine.tokenizer
    hf = tuple(load_model(m.path, m.dtype).model for m in (engine.target_model, engine.draft_model))
    windows = _prompts(tok, fam, args.windows, args.window_tokens, seed=1)
    prompts = _prompts(tok, fam, args.prompts, args.prompt_tokens, seed=2)
    results = {"family": str(fam), "k": args.k, "new_tokens": args.new_tokens,
               "noise_samples": args.noise_samples, "temperatures": {}}
    for t in (float(x) for x in args.temperatures.split(",")):
        row = {"teacher_forced": teacher_forced(hf, windows, t, args.noise_samples),
               "generation_coupled": in_generation(engine, prompts, t, args.k, args.new_tokens, True),
               "generation_rejection": in_generation(engine, prompts, t, args.k, args.new_tokens,
                                                     False)}
        results["temperatures"][str(t)] = row
        print(f"T={t}: teacher-forced a: rejection {row['teacher_forced']['rejection']:.3f}, "
              f"coupled {row['teacher_forced']['coupled']:.3f}; in generation (k={args.k}) a: "
              f"rejection {row['generation_rejection']['token_acceptance']:.3f}, coupled "
              f"{row['generation_coupled']['token_acceptance']:.3f}", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
