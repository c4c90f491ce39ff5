"""KV memory as one byte budget, shared by the target and the draft.

Owns: the single pool of fixed-size blocks that holds every sequence's keys and values, for the
target and the draft alike, and the accounting of it in bytes. A block is `block_bytes` long
(`tokens_per_block` target tokens across all target layers); a draft block is the same bytes and
holds as many draft tokens as fit (a draft token is cheaper). So a speculative sequence is charged
for both models out of one budget, and memory freed by one model is reused by the other at once.
Does not own: which sequence gets blocks (the scheduler) nor attention (`engine/attention.py`).

Layout: `pool` is `[num_blocks, block_elems]`; each model sees it through a view
`[num_blocks, tokens_per_block, num_layers, 2, num_kv_heads, head_dim]` (2 = key, value).
Tokens are the outer dimension inside a block and a block is exactly `tokens_per_block` tokens
of its model, so the tokens of consecutive blocks are evenly strided: a sequence whose blocks are
consecutive has its keys of one layer as a plain strided view, and attention reads them in place
without gathering. The allocator therefore tries to keep each sequence's blocks consecutive
(it places a new sequence in the middle of the largest free run, and extends a sequence with the
block after its last one when that is free); when it cannot, attention gathers the blocks.
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


def _tokens_per_block(block_size: int, target_elems: int, draft_elems: int | None) -> int:
    """The smallest multiple of block_size whose block a draft fills exactly (if one is near)."""
    if draft_elems is None:
        return block_size
    for m in range(1, 17):
        if (m * block_size * target_elems) % draft_elems == 0:
            return m * block_size
    return block_size


class BlockPool:
    """A fixed number of equal blocks carved out of a byte budget, and their allocator."""

    def __init__(self, budget_bytes: int, target: tuple[int, int, int], block_size: int,
                 dtype: torch.dtype, device: torch.device | str,
                 draft: tuple[int, int, int] | None = None):
        """target, draft: (num_layers, num_kv_heads, head_dim) of each model's (per-rank) KV."""
        self.dtype = dtype
        self.element_size = torch.empty((), dtype=dtype).element_size()
        draft_elems = 2 * draft[0] * draft[1] * draft[2] if draft else None
        tpb = _tokens_per_block(block_size, 2 * target[0] * target[1] * target[2], draft_elems)
        self.target = KVLayout(*target, tokens_per_block=tpb)
        self.block_elems = self.target.elems_per_block
        self.block_bytes = self.block_elems * self.element_size
        self.draft = None
        if draft is not None:
            tokens = self.block_elems // draft_elems
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
        self._free = bytearray(b"\x01") * self.num_blocks     # 1 = free
        self.num_free = self.num_blocks
        self.used_by = {"target": 0, "draft": 0}

    def view(self, layout: KVLayout) -> torch.Tensor:
        """[num_blocks, num_layers, 2, tokens_per_block, num_kv_heads, head_dim], sharing `pool`.
        Layer-major inside a block: one layer's keys (or values) of a block are contiguous, so
        attention reads a block as one run of memory."""
        return self.pool[:, :layout.elems_per_block].view(
            self.num_blocks, layout.num_layers, 2, layout.tokens_per_block,
            layout.num_kv_heads, layout.head_dim)

    def layers(self, layout: KVLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V), each [num_blocks, tokens_per_block, num_kv_heads, head_dim]."""
        view = self.view(layout)
        return [(view[:, i, 0], view[:, i, 1]) for i in range(layout.num_layers)]

    # ---- allocation -------------------------------------------------------------------------
    def allocate(self, n: int, owner: str, after: int | None = None) -> list[int]:
        """n blocks; consecutive after block `after` when possible, else from a free run."""
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free} free")
        if n == 0:
            return []
        start = None
        if after is not None and self._free[after + 1:after + 1 + n] == b"\x01" * n:
            start = after + 1
        elif after is None:
            start = self._place(n)
        if start is not None:
            blocks = list(range(start, start + n))
        else:
            blocks = self._scattered(n, 0 if after is None else after + 1)
        for b in blocks:
            self._free[b] = 0
        # Handed out zeroed: attention reads whole blocks (the block gather for SDPA and the fused
        # kernel alike), so slots past a sequence's end are read under a zero weight, and 0 * v
        # must be 0, which uninitialised memory or a stale NaN would break (and leak across
        # requests).
        if n == 1:
            self.pool[blocks[0]].zero_()
        else:
            self.pool.index_fill_(0, torch.tensor(blocks, device=self.pool.device), 0)
        self.num_free -= n
        self.used_by[owner] += n
        return blocks

    def _runs(self):
        """(start, length) of every free run."""
        pos, free = 0, self._free
        while True:
            start = free.find(1, pos)
            if start < 0:
                return
            end = free.find(0, start)
            end = len(free) if end < 0 else end
            yield start, end - start
            pos = end

    def _place(self, n: int) -> int | None:
        """A new sequence goes to the largest free run: at its start if nothing precedes it,
        else at its middle, leaving the sequence before it room to grow."""
        best = max(self._runs(), key=lambda r: r[1], default=None)
        if best is None or best[1] < n:
            return None
        start, length = best
        return start if start == 0 else start + (length - n) // 2

    def _scattered(self, n: int, near: int) -> list[int]:
        blocks, pos = [], near
        while len(blocks) < n:
            b = self._free.find(1, pos)
            if b < 0:
                b = self._free.find(1)
            blocks.append(b)
            self._free[b] = 0          # provisional, so find() moves on; set again by caller
            pos = b + 1
        return blocks

    def free(self, blocks: list[int], owner: str) -> None:
        for b in blocks:
            self._free[b] = 1
        self.num_free += len(blocks)
        self.used_by[owner] -= len(blocks)

    def bytes_used(self, owner: str) -> int:
        return self.used_by[owner] * self.block_bytes


def blocks_needed(num_tokens: int, tokens_per_block: int) -> int:
    return -(-num_tokens // tokens_per_block)
