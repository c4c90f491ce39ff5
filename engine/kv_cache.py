"""KV memory as one byte budget, shared by the target and the draft.

Owns: the single pool of fixed-size blocks that holds every sequence's keys and values, for the
target and the draft alike, and the accounting of it in bytes. A block is `block_bytes` long
(`block_size` target tokens across all target layers); a draft block is the same bytes and holds
as many draft tokens as fit (a draft token is cheaper). So a speculative sequence is charged for
both models out of one budget, and memory freed by one model is reused by the other at once.
Does not own: which sequence gets blocks (the scheduler) nor attention (`engine/attention.py`).

Layout: `pool` is `[num_blocks, block_elems]`; each model sees it through a view
`[num_blocks, num_layers, 2, tokens_per_block, num_kv_heads, head_dim]` over the first elements
of every block (2 = key, value).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """How one model's KV maps onto a block."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int

    @property
    def elems_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def elems_per_block(self) -> int:
        return self.tokens_per_block * self.elems_per_token


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for (the scheduler checks first)."""


class BlockPool:
    """A fixed number of equal blocks carved out of a byte budget, and a free list."""

    def __init__(self, budget_bytes: int, target: tuple[int, int, int], block_size: int,
                 dtype: torch.dtype, device: torch.device | str,
                 draft: tuple[int, int, int] | None = None):
        """target, draft: (num_layers, num_kv_heads, head_dim) of each model's (per-rank) KV."""
        self.dtype = dtype
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.target = KVLayout(*target, tokens_per_block=block_size)
        self.block_elems = self.target.elems_per_block
        self.block_bytes = self.block_elems * self.element_size
        self.draft = None
        if draft is not None:
            per_token = 2 * draft[0] * draft[1] * draft[2]
            tokens = self.block_elems // per_token
            if tokens < 1:
                raise ValueError("a draft token's KV is larger than a whole target block; "
                                 "raise block_size")
            self.draft = KVLayout(*draft, tokens_per_block=tokens)
        self.num_blocks = int(budget_bytes // self.block_bytes)
        if self.num_blocks < 2:
            raise ValueError(f"KV budget of {budget_bytes} bytes holds fewer than 2 blocks of "
                             f"{self.block_bytes} bytes")
        self.budget_bytes = self.num_blocks * self.block_bytes
        self.pool = torch.empty(self.num_blocks, self.block_elems, dtype=dtype, device=device)
        self._free = list(range(self.num_blocks - 1, -1, -1))   # pop() hands out low ids first
        self.used_by = {"target": 0, "draft": 0}

    def view(self, layout: KVLayout) -> torch.Tensor:
        """[num_blocks, num_layers, 2, tokens_per_block, num_kv_heads, head_dim], sharing `pool`."""
        return self.pool[:, :layout.elems_per_block].view(
            self.num_blocks, layout.num_layers, 2, layout.tokens_per_block,
            layout.num_kv_heads, layout.head_dim)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int, owner: str) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        self.used_by[owner] += n
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int], owner: str) -> None:
        self.used_by[owner] -= len(blocks)
        self._free.extend(blocks)

    def bytes_used(self, owner: str) -> int:
        return self.used_by[owner] * self.block_bytes


def blocks_needed(num_tokens: int, tokens_per_block: int) -> int:
    return -(-num_tokens // tokens_per_block)
