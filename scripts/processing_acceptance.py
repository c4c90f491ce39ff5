"""Draft acceptance under logits processing: penalties + bias, a JSON schema, any JSON object.

For each kind of processing, runs the same requests speculatively (fixed k) twice: with the
draft's rows processed like the target's (what the engine does, engine/logits_processors.py)
and with the draft's rows left raw (the alternative: still exact, since the target's rows are
processed, but the draft proposes from another distribution). Prints acceptance_rate
(accepted / drafted), the mean acceptance length, output tokens per second of the whole run
(prefill included) and the grammar compile times.
Figures: docs/decisions/0026-processing-under-speculation.md.

    .venv/bin/python scripts/processing_acceptance.py [FAMILY] [--requests 16] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "size": {"type": "integer"},
                         "public": {"type": "boolean"},
                         "kind": {"enum": ["module", "class", "function"]}},
          "required": ["name", "size", "public", "kind"]}
PROCESSING = {
    "none": {},
    "penalties+bias": {"presence_penalty": 0.5, "frequency_penalty": 0.5,
                       "repetition_penalty": 1.1, "logit_bias": {"13": 2.0, "25": -5.0}},
    "json_schema": {"json_schema": json.dumps(SCHEMA)},
    "json_object": {"json_schema": '{"type": "object"}'},
}


def _prompts(n: int) -> list[str]:
    lines = (ROOT / "cluster/prompts/code.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


def _run(engine, prompts, kw, k, temperature):
    from engine.sampling_params import RequestOptions, SamplingParams

    before = engine.snapshot()
    start, steps, emitted = time.perf_counter(), 0, 0
    for i, p in enumerate(prompts):
        ids = engine.tokenizer(p)["input_ids"]
        engine.add_request(f"r{i}", ids, SamplingParams(temperature=temperature, max_tokens=64,
                                                        **kw),
                           RequestOptions("speculative", k_max=k))
    while engine.has_unfinished():
        emitted += sum(len(o.token_ids) for o in engine.step())
        steps += 1
    seconds = time.perf_counter() - start
    after = engine.snapshot()
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    drafts = after.num_drafts - before.num_drafts
    return {"acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "tokens_per_s": emitted / seconds, "steps": steps, "emitted": emitted}


def main() -> None:
    import torch

    import engine.spec_decode as spec_decode
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    ap = argparse.ArgumentParser()
    ap.add_argument("family", nargs="?", default="/work/shared/models/reference-py")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    family = Path(args.family)
    engine = LLMEngine(EngineConfig(str(family / "target"), str(family / "draft"),
                                    adaptive_k=False, num_threads=1, profile=False,
                                    max_num_seqs=args.requests, kv_budget_bytes=256 << 20))
    for name, kw in PROCESSING.items():
        if "json_schema" in kw:
            start = time.perf_counter()
            engine.processors.grammars.compile(kw["json_schema"])
            print(f"{name}: compiled in {time.perf_counter() - start:.2f} s")
    prompts = _prompts(args.requests)
    processed = spec_decode.process

    def target_rows_only(logits, rows):     # the alternative: the draft proposes from raw q
        return logits if sys._getframe(1).f_code.co_name == "propose" else processed(logits, rows)

    print(f"k={args.k} T={args.temperature} requests={args.requests} family={family.name}")
    for name, kw in PROCESSING.items():
        for draft_rows in ("processed", "raw"):
            if name == "none" and draft_rows == "raw":
                continue
            spec_decode.process = processed if draft_rows == "processed" else target_rows_only
            r = _run(engine, prompts, kw, args.k, args.temperature)
            print(f"{name:15s} draft rows {draft_rows:9s} acceptance_rate "
                  f"{r['acceptance_rate']:.3f}  mean acceptance length "
                  f"{r['mean_acceptance_length']:.2f}  {r['tokens_per_s']:.0f} tok/s  "
                  f"{r['emitted']} tokens in {r['steps']} steps")
    spec_decode.process = processed


if __name__ == "__main__":
    main()
