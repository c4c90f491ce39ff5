"""`specserve draft prompts`: write the built-in prompt set (code, prose, chat) as JSONL."""

from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="JSONL file to write")
    p.add_argument("--per-class", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    from models.distill_prompts import builtin_prompts, write_prompts

    rows = builtin_prompts(args.per_class, args.seed)
    write_prompts(args.out, rows)
    print(f"wrote {len(rows)} prompts to {args.out}")
    return 0
