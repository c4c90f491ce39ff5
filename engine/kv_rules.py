"""The scheduler's memory rules: who is admitted, who keeps speculating, who yields first.

One home for the rules that the engine's scheduler (`engine/scheduler.py`, counting KV blocks)
and the simulator's replicas (`cluster/sim/replica.py`, counting bytes on each GPU) both apply,
so that the simulator cannot drift from the engine. Amounts are in the caller's unit: blocks,
or bytes on one GPU. Pure Python. Does not own: the loops that apply these rules, nor the
blocks themselves (`engine/kv_cache.py`).

Why a speculative request is admitted as baseline below a headroom, and why speculation is
dropped before anyone is preempted: docs/decisions/0001-draft-kv-in-one-budget.md.
"""

from __future__ import annotations

import math
from typing import Callable, TypeVar

T = TypeVar("T")

# Below this share of the KV budget left free, a new speculative request is admitted as baseline.
SPEC_MIN_FREE_FRACTION = 0.10


def blocks_needed(num_tokens: int, tokens_per_block: int) -> int:
    """Whole blocks that hold num_tokens tokens."""
    return -(-num_tokens // tokens_per_block)


def fits_beside_growth(need: float, free: float, num_running: int, growth_block: float) -> bool:
    """The admission test: a waiting request's first chunk, needing `need`, is admitted only
    beside one growth block (`growth_block`) per running sequence, so that admitting it does
    not push a running sequence out on its next step."""
    return need <= free - num_running * growth_block


def keeps_speculation(free_after: float, budget: float,
                      min_free_fraction: float = SPEC_MIN_FREE_FRACTION) -> bool:
    """The downgrade threshold: a speculative request is admitted speculative only where at
    least `min_free_fraction` of the budget stays free after it (`free_after`); below that it
    is admitted as baseline, for good."""
    return free_after >= min_free_fraction * budget


def prefix_unit(tokens_per_block: int, prefill_align: int) -> int:
    """The step in which a cached prefix is taken: whole blocks that end where a prompt chunk
    may be cut, so the rest is cut and attended as without the cache."""
    return math.lcm(tokens_per_block, prefill_align)


def reusable_prefix(prompt_tokens: int, cached_tokens: int, unit: int) -> int:
    """The prompt tokens a sequence takes from the prefix cache, where the cache holds the
    first `cached_tokens` of its prompt: whole units of `unit` tokens (a multiple of the block
    and of the prefill alignment: `prefix_unit`), never the last prompt token, whose logits are
    needed."""
    return min(cached_tokens, prompt_tokens - 1) // unit * unit


def victim_order(seqs: list[T], priority: Callable[[T], int],
                 arrival: Callable[[T], float]) -> list[T]:
    """Who yields first when a step's KV does not fit: the lowest priority first, and among
    equals the latest arrival."""
    return sorted(seqs, key=lambda s: (priority(s), -arrival(s)))


def next_victim(seqs: list[T], priority: Callable[[T], int], arrival: Callable[[T], float],
                speculating: Callable[[T], bool]) -> tuple[T, bool]:
    """(victim, drops speculation) when a step's KV does not fit: the first sequence in
    `victim_order` that speculates (holds or is about to write draft KV) drops to baseline,
    freeing its draft KV; only where none does is the first in that order preempted."""
    order = victim_order(seqs, priority, arrival)
    for s in order:
        if speculating(s):
            return s, True
    return order[0], False
