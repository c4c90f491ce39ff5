"""`specserve models plan CONFIG`: each tier's GPU memory plan, before any GPU is touched.

For every tier of an app config that runs on CUDA: rank 0's device memory at the tier's
`gpu_memory_utilization`, less its weights (its shard of the target and the whole draft), an
estimate of its peak activations and the CUDA context, and the KV budget left, in tokens and in
`max_model_len` sequences (engine/memory.py, `plan_from_specs`; a served replica measures its
activations instead). Shapes come from each checkpoint's config.json where the folder exists,
else from the preset its name names (engine/hardware.py). Exit 1 if a tier cannot hold one
full-length sequence.
"""

from __future__ import annotations

import json
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
               "auto": 2}


def add_arguments(p) -> None:
    p.add_argument("config", help="app config (YAML), e.g. cluster/configs/llama2-70b-4xa100.yaml")
    p.add_argument("--gpu", default="A100-80GB", help="GPU preset (engine/hardware.py: GPUS)")


def _spec(path: str):
    from engine.hardware import model_spec_for

    config_file = Path(path) / "config.json"
    return model_spec_for(path, json.loads(config_file.read_text()) if config_file.is_file() else None)


def tier_plan(tier, gpu):
    """A tier's MemoryPlan on `gpu` (an engine.hardware.GPUSpec)."""
    from engine.config import EngineConfig
    from engine.memory import plan_from_specs

    target = _spec(tier.model)
    draft = _spec(tier.draft) if tier.draft else None
    max_len = tier.max_model_len
    if max_len is None:
        raise ValueError(f"give the tier of {tier.model} a max_model_len to plan for")
    batched = tier.engine_args.get("max_num_batched_tokens",
                                   EngineConfig.max_num_batched_tokens)
    return plan_from_specs(gpu.memory_bytes, tier.gpu_memory_utilization, target, draft,
                           tier.tp_size, DTYPE_BYTES[tier.dtype], batched, tier.max_num_seqs,
                           max_len)


def run(args) -> int:
    from engine.hardware import GPUS
    from router.config import load_config

    if args.gpu not in GPUS:
        print(f"specserve: unknown GPU {args.gpu!r}; presets: {sorted(GPUS)}")
        return 2
    gpu = GPUS[args.gpu]
    try:
        cfg = load_config(args.config)
    except (OSError, ValueError) as exc:          # a missing file, or one that does not validate
        print(f"specserve: {exc}")
        return 2
    ok = True
    for name, tier in (("target", cfg.target), ("small", cfg.small)):
        if tier is None or tier.device != "cuda":
            continue
        try:
            plan = tier_plan(tier, gpu)
        except (KeyError, ValueError) as exc:
            print(f"specserve: tier {name}: {exc}")
            return 2
        fits = plan.kv_budget_bytes >= plan.min_kv_bytes
        ok &= fits
        seqs = plan.max_tokens // plan.max_model_len
        print(f"{name}: {tier.model}" + (f" + draft {tier.draft}" if tier.draft else "")
              + f", tp_size {tier.tp_size}, rank 0 on {gpu.name}")
        print(plan.describe())
        print(f"  {'full-length sequences at once':<40} {seqs:9d}"
              f"  (max_num_seqs {tier.max_num_seqs})  {'fits' if fits else 'DOES NOT FIT'}\n")
    return 0 if ok else 1
