"""`specserve draft distill`: the target writes continuations, DeepSpeed trains the draft on them.

The target's continuations come from the project's engine (batched, baseline mode, sampled at the
temperature the draft will serve at), cached in OUT/data.pt so a resumed run skips them; the
training is `models/distill_train.py`. `specserve draft prompts` writes the built-in prompt set.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("--target", required=True, help="target HF folder (the teacher)")
    p.add_argument("--draft", required=True, help="the draft (or small model) to start from")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="JSONL file of {'prompt', 'class'} rows")
    src.add_argument("--from-buffer", help="a traffic-capture buffer folder (router/capture.py)")
    p.add_argument("--out", required=True, help="output HF folder (also holds checkpoints, report)")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--minutes", type=float, help="training time budget (resumes count it)")
    budget.add_argument("--steps", type=int, help="DeepSpeed optimizer steps in total")
    p.add_argument("--role", choices=("draft", "small"), default="draft")
    p.add_argument("--ds-config", help="DeepSpeed JSON config (ZeRO stage, offload, bf16, optimizer)")
    p.add_argument("--temperature", type=_temperatures, default=[1.0],
                   help="the sampling temperature served, or several comma-separated (0: greedy; "
                        "acceptance is then argmax agreement); continuations at each")
    p.add_argument("--replay", type=_count, default=0, metavar="N",
                   help="add N prompts (class 'replay') cut from this Python's standard library: "
                        "the draft keeps its agreement on general code while distilled on the rest")
    p.add_argument("--replay-drop", type=_fraction, default=None, metavar="D",
                   help="how far the replayed class's acceptance may fall, in the kept step's "
                        "choice and in the swap guard (default: the guard's 0.02, as every class)")
    p.add_argument("--guard-prompts", help="JSONL prompts of other traffic the draft serves: never "
                   "trained on, scored before and after; `draft swap` refuses a drop there too")
    p.add_argument("--max-prompts", type=_at_least_one, default=None, metavar="N",
                   help="distinct prompts kept, the newest (a capture buffer may hold thousands)")
    p.add_argument("--focus", metavar="CLASS", help="with --max-prompts: the class to lift "
                   "takes half of them, the other classes share the rest")
    p.add_argument("--new-tokens", type=int, default=64, help="target tokens generated per prompt")
    p.add_argument("--samples", type=int, default=1, help="target continuations per prompt")
    p.add_argument("--heldout", type=_fraction, default=0.15, help="fraction of prompts held out per class")
    p.add_argument("--validation", type=_fraction, default=0.05,
                   help="fraction of each class's training prompts that pick the kept weights: "
                        "the best-scoring step with no class below the given draft's by more "
                        "than the swap guard allows (early stopping)")
    p.add_argument("--eval-every-s", type=_positive, default=60.0, help="seconds between validation scores")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt-tokens", type=int, default=96)
    p.add_argument("--max-num-seqs", type=int, default=32, help="engine batch for the continuations")
    p.add_argument("--top-k", type=int, default=64, help="teacher log-probs cached per position")
    p.add_argument("--divergence", choices=("kl", "tv"), default=None,
                   help="the loss: forward KL to the target, or total variation (1 - acceptance); "
                        "default: tv where every served temperature samples, else kl")
    p.add_argument("--on-policy", type=_share, default=None, metavar="SHARE",
                   help="share of steps trained on fresh continuations (--rollouts), scored by "
                        "the target; default: 1 where every served temperature samples, else 0")
    p.add_argument("--rollouts", choices=("student", "target"), default=None,
                   help="who writes the on-policy steps' fresh continuations: the draft itself, "
                        "or the target through the engine (the distribution served contexts "
                        "follow); default: the target where every served temperature samples")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate of the default config")
    p.add_argument("--anneal", type=_share, default=None, metavar="SHARE",
                   help="the last SHARE of the budget (steps, or time) takes the learning rate "
                        "linearly to 0; default: 0.4 where every served temperature samples, else 0")
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch of the default config")


def _temperatures(text: str) -> list[float]:
    try:
        temps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        temps = []
    if not temps or any(not 0 <= t <= 100 for t in temps) or len(set(temps)) < len(temps):
        raise argparse.ArgumentTypeError(f"distinct numbers in [0, 100], comma-separated; got {text!r}")
    return temps


def _number(text: str, ok, what: str) -> float:
    """float(text) where ok(value), else argparse's error naming `what` (a non-number is NaN,
    which no range admits)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
    return value


def _fraction(text: str) -> float:
    return _number(text, lambda v: 0 <= v < 1, "a fraction in [0, 1)")


def _share(text: str) -> float:
    return _number(text, lambda v: 0 <= v <= 1, "a share in [0, 1]")


def _positive(text: str) -> float:
    return _number(text, lambda v: v > 0, "a number above 0")


def _count(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"a whole number >= 0, got {text!r}")
    return int(text)


def _at_least_one(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number >= 1, got {text!r}")
    return value


def prepare_data(args, source: str, name: str = "data.pt", log=print):
    """The target's continuations of `source`'s prompts at each served temperature (`--samples`
    each; one at temperature 0, where they would all be the same), cached in OUT/`name`."""
    from engine.sampling_params import GREEDY_BELOW
    from models.distill import DistillData, at_temperature
    from models.distill_prompts import read_prompts, select_prompts
    from models.distill_rollouts import generate
    from models.loader import load_tokenizer

    out = Path(args.out)
    cache = out / name
    if cache.exists():
        return DistillData.load(cache)
    rows = read_prompts(source)
    if name == "data.pt":
        rows = select_prompts(rows, args.max_prompts, args.focus)
        if args.replay:
            from models.distill_prompts import replay_prompts

            rows += replay_prompts(args.replay, args.seed)
    tok = load_tokenizer(args.target)
    ids = [tok(r["prompt"])["input_ids"][-args.max_prompt_tokens:] for r in rows]
    keep = [i for i, x in enumerate(ids) if x]
    table = []
    for t in args.temperature:
        n = args.samples if t >= GREEDY_BELOW else 1
        prompts = [ids[i] for i in keep for _ in range(n)]
        classes = [rows[i]["class"] if len(args.temperature) == 1 else at_temperature(rows[i]["class"], t)
                   for i in keep for _ in range(n)]
        conts = generate(args.target, prompts, args.new_tokens, t, args.seed, args.threads,
                         log, args.max_num_seqs)
        table += [(p, c, k) for p, c, k in zip(prompts, conts, classes) if c]
    data = DistillData.from_rows(table)
    out.mkdir(parents=True, exist_ok=True)
    data.save(cache)
    return data


def run(args) -> int:
    import torch

    from models.distill import default_ds_config
    from models.distill_train import run_distill
    from models.loader import ModelLoadError

    if args.focus and not args.max_prompts:
        print("specserve draft distill: --focus needs --max-prompts (the focus takes half of "
              "them)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        config = default_ds_config(args.batch_size, args.lr)
        if args.ds_config:
            config = json.loads(Path(args.ds_config).read_text())
        data = prepare_data(args, args.prompts or args.from_buffer)
        guard = prepare_data(args, args.guard_prompts, "guard.pt") if args.guard_prompts else None
        temps = args.temperature[0] if len(args.temperature) == 1 else args.temperature
        report = run_distill(args.target, args.draft, data, args.out, temps,
                             steps=args.steps, minutes=args.minutes, ds_config=config,
                             heldout=args.heldout, seed=args.seed, role=args.role,
                             top_k=args.top_k, validation=args.validation,
                             eval_every_s=args.eval_every_s, guard_data=guard,
                             divergence=args.divergence, on_policy=args.on_policy,
                             drops=None if args.replay_drop is None else {"replay": args.replay_drop},
                             anneal=args.anneal, rollouts=args.rollouts)
    except (ModelLoadError, ValueError, OSError) as exc:
        print(f"specserve draft distill: {exc}", file=sys.stderr)
        return 1
    write_heldout_prompts(args, data)
    print(json.dumps(report["heldout"]["delta"]))
    return 0


def write_heldout_prompts(args, data) -> None:
    """OUT/heldout_prompts.jsonl: the held-out prompts as text, for `specserve draft bench`; the
    same split by class in OUT/heldout/CLASS.jsonl, for `specserve bench serve --prompts`."""
    from models.distill import base_class, split_heldout
    from models.distill_prompts import write_prompts
    from models.loader import load_tokenizer

    tok = load_tokenizer(args.target)
    groups = data.prompt_groups()
    _, held = split_heldout(data.classes, args.heldout, args.seed, groups)
    held = sorted({groups[i]: i for i in reversed(held)}.values())   # one row per prompt, the first
    rows = [{"prompt": tok.decode(data.tokens[i, :int(data.prompt_lens[i])].tolist()),
             "class": base_class(data.classes[i])} for i in held]
    write_prompts(Path(args.out) / "heldout_prompts.jsonl", rows)
    by_class = Path(args.out) / "heldout"          # CLASS.jsonl files: `bench serve --prompts`
    by_class.mkdir(exist_ok=True)
    for cls in sorted({r["class"] for r in rows}):
        write_prompts(by_class / f"{cls}.jsonl", [r for r in rows if r["class"] == cls])
