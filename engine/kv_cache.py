"""KV memory as one byte budget, shared by the target and the draft.

Owns: the single pool of fixed-size blocks that holds every sequence's keys and values, for the
target and the draft alike, and the accounting of it in bytes. A block is `block_bytes` long
(`tokens_per_block` target tokens across all target layers); a draft block is the same bytes and
holds as many draft tokens as fit (a draft token is cheaper). So a speculative sequence is charged
for both models out of one budget, and memory freed by one model is reused by the other at once.
Does not own: which sequence gets blocks (the scheduler) nor attention (`engine/attention.py`).

Blocks are refcounted: a block of a cached prompt prefix may be held by several sequences at
once and is counted once in the budget. A block whose last holder lets go stays cached if it
carries a prefix key (`engine/prefix_cache.py`): it is counted free (`num_free`), sits in an LRU
list, and keeps its KV until `allocate` needs it, oldest first. A block that any sequence holds is
never handed out again.

Layout: plane-major. `pool` is `[planes, num_blocks, plane_elems]`: block b is the slice
`pool[:, b]`, one run of `plane_elems` in each plane. A plane holds one (layer, key or value) of
the target (or a share of one, see `chunks`), so one layer's keys for ALL blocks are one
contiguous array, and a sequence whose blocks are consecutive has its keys of a layer in one
contiguous run, which the hardware prefetcher streams. The allocator therefore keeps each
sequence's blocks consecutive where it can (a new sequence goes to the middle of the largest
free run; a sequence grows into the block after its last one when that is free).

Within a block's run of a plane, rows are head-major (vLLM's CPU cache orders a block so too):
one KV head's keys of a block are one run, which the attention kernel reads front to back,
rather than 1/heads of every token's row per pass. Values are
`[num_kv_heads, tokens_per_chunk, head_dim]`; keys are d-major within their head,
`[num_kv_heads, head_dim, tokens_per_chunk]`, so that the kernel scores a vector's width of keys
at once, accumulating over the head dimension, with no horizontal sum per key
(`engine/cpu_attention.py`). A token's key is written as head_dim strided elements; one token a
step per sequence, against every key read every step. What each of these choices is worth:
docs/decisions/0002-kv-pool-layout.md. A token-major pool (`token_major`: GPUs, FlexAttention)
lays every chunk of keys and values out as `[tokens_per_chunk, num_kv_heads, head_dim]`, so a
(layer, K/V) is one array of token rows that a paged kernel reads in place
(docs/decisions/0037-flex-attention-on-gpus.md).

Each model sees the pool through `layers(layout)`: per layer (K, V), each
`[num_blocks, chunks, tokens_per_chunk, num_kv_heads, head_dim]`, a strided view. The plane
count is a common multiple of both models' (layer, K/V) counts, so a target's and a draft's
(layer, K/V) each own whole planes (`chunks` of them: 1 for a target whose layer count the
draft's divides), and a block holds exactly `tokens_per_block` tokens of either model when the
sizes allow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.host_sync import upload
from engine.prefix_cache import PrefixCache


@dataclass(frozen=True)
class KVLayout:
    """How one model's KV maps onto a block."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    chunks: int = 1          # planes each (layer, K/V) spans; tokens_per_block splits evenly

    @property
    def elems_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def elems_per_block(self) -> int:
        return self.tokens_per_block * self.elems_per_token


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for (the scheduler checks first)."""


def _plan(block_size: int, target: tuple[int, int, int],
          draft: tuple[int, int, int] | None) -> tuple[int, int]:
    """(planes, tokens_per_block): a common multiple of both models' (layer, K/V) counts as the
    planes, and the smallest multiple of block_size that splits evenly over the target's chunks
    and whose plane run a draft fills exactly (the first that splits evenly if none near)."""
    planes = 2 * target[0] if draft is None else math.lcm(2 * target[0], 2 * draft[0])
    chunks = planes // (2 * target[0])
    row_t = target[1] * target[2]
    fits = [m * block_size for m in range(1, 16 * chunks + 1) if (m * block_size) % chunks == 0]
    if draft is not None:
        exact = [tpb for tpb in fits if (tpb // chunks * row_t) % (draft[1] * draft[2]) == 0]
        if exact:
            return planes, exact[0]
    return planes, fits[0]


class BlockPool:
    """A fixed number of equal blocks carved out of a byte budget, and their allocator."""

    def __init__(self, budget_bytes: int, target: tuple[int, int, int], block_size: int,
                 dtype: torch.dtype, device: torch.device | str,
                 draft: tuple[int, int, int] | None = None, resident: bool = False,
                 num_blocks: int | None = None, token_major: bool = False):
        """target, draft: (num_layers, num_kv_heads, head_dim) of each model's (per-rank) KV.
        resident: write the whole pool now. On CPU `torch.empty` only reserves address space
        and the kernel maps each page at its first write, in whichever step first hands out its
        block, so a served replica's first requests would pay a page fault per fresh block
        (docs/decisions/0002-kv-pool-layout.md). Written at start, the budget is resident (or
        fails to be at start, not under load).
        token_major: every chunk of keys and values `[tokens_per_chunk, num_kv_heads,
        head_dim]`, the layout paged kernels on GPUs read (`engine/flex_attention.py`);
        False: head-major with d-major keys, the CPU kernel's (`engine/attention.py:
        token_major` decides)."""
        self.dtype, self.token_major = dtype, token_major
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.planes, tpb = _plan(block_size, target, draft)
        chunks = self.planes // (2 * target[0])
        self.target = KVLayout(*target, tokens_per_block=tpb, chunks=chunks)
        self.block_elems = self.target.elems_per_block
        self.plane_elems = self.block_elems // self.planes
        self.block_bytes = self.block_elems * self.element_size
        self.draft = None
        if draft is not None:
            chunks = self.planes // (2 * draft[0])
            per_chunk = self.plane_elems // (draft[1] * draft[2])
            if per_chunk < 1:
                raise ValueError("a draft token's KV is larger than a plane of a target block; "
                                 "raise block_size")
            self.draft = KVLayout(*draft, tokens_per_block=chunks * per_chunk, chunks=chunks)
        # num_blocks: exactly that many (a scratch pool), whatever the budget says
        self.num_blocks = num_blocks or int(budget_bytes // self.block_bytes)
        if self.num_blocks < 2:
            raise ValueError(f"KV budget of {budget_bytes} bytes holds fewer than 2 blocks of "
                             f"{self.block_bytes} bytes")
        self.budget_bytes = self.num_blocks * self.block_bytes
        self.pool = torch.empty(self.planes, self.num_blocks, self.plane_elems, dtype=dtype,
                                device=device)
        if resident:
            self.pool.zero_()
        self._free = bytearray(b"\x01") * self.num_blocks     # 1 = free and holds nothing kept
        self.refs = [0] * self.num_blocks                       # sequences holding each block
        self.cache = PrefixCache()                              # kept blocks: key map and LRU
        # blocks handed out since `take_zeroed` last ran (None: nobody asks): the other ranks of
        # a tensor-parallel group zero the same blocks of their own pools before the next forward
        self._zeroed: list[int] | None = None
        self.num_empty = self.num_blocks                        # blocks with _free set
        self.used_by = {"target": 0, "draft": 0}

    def layers(self, layout: KVLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V), each [num_blocks, chunks, tokens_per_chunk, num_kv_heads, head_dim],
        views of `pool`: (layer i, K/V c) is planes (2i + c) * chunks onwards. Token t of a block
        is chunk t // tokens_per_chunk, row t % tokens_per_chunk; in memory a chunk of values is
        [num_kv_heads, tokens_per_chunk, head_dim] and of keys [num_kv_heads, head_dim,
        tokens_per_chunk] (head-major, keys d-major: see the module's doc)."""
        m = layout.chunks
        per_chunk = layout.tokens_per_block // m
        row = layout.num_kv_heads * layout.head_dim
        out = []
        heads, d = layout.num_kv_heads, layout.head_dim
        for i in range(layout.num_layers):
            k = self.pool[2 * i * m:(2 * i + 1) * m, :, :per_chunk * row]
            v = self.pool[(2 * i + 1) * m:(2 * i + 2) * m, :, :per_chunk * row]
            if self.token_major:
                out.append(tuple(t.unflatten(2, (per_chunk, heads, d)).permute(1, 0, 2, 3, 4)
                                 for t in (k, v)))
                continue
            out.append((k.unflatten(2, (heads, d, per_chunk)).permute(1, 0, 4, 2, 3),
                        v.unflatten(2, (heads, per_chunk, d)).permute(1, 0, 3, 2, 4)))
        return out

    # ---- allocation -------------------------------------------------------------------------
    def reserve(self) -> int:
        """Take the last block out of the pool for good, before any allocation: a CUDA graph's
        scratch block (`engine/cuda_graphs.py`), where padding tokens write their KV and which
        no sequence reads. The pool then counts one block fewer."""
        block = self.num_blocks - 1
        if self.num_empty != self.num_blocks or self.num_blocks < 3:
            raise ValueError("reserve a block before any allocation, from a pool of 3 or more")
        self._free[block] = 0
        self.num_empty -= 1
        self.num_blocks -= 1
        return block

    def allocate(self, n: int, owner: str, after: int | None = None) -> list[int]:
        """n blocks; consecutive after block `after` when possible, else from a free run."""
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free} free")
        if n == 0:
            return []
        for b in self.cache.evict(n - self.num_empty):
            self._free[b] = 1
            self.num_empty += 1
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
            self.refs[b] = 1
        # Handed out zeroed: attention reads whole blocks (the block gather for SDPA and the fused
        # kernel alike), so slots past a sequence's end are read under a zero weight, and 0 * v
        # must be 0, which uninitialised memory or a stale NaN would break (and leak across
        # requests).
        if n == 1:
            self.pool[:, blocks[0]].zero_()
        else:
            self.pool.index_fill_(1, upload(blocks, torch.long, self.pool.device), 0)
        if self._zeroed is not None:
            self._zeroed.extend(blocks)
        self.num_empty -= n
        self.used_by[owner] += n
        return blocks

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: empty ones and kept ones no sequence holds."""
        return self.num_empty + self.cache.num_evictable

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

    def take_zeroed(self) -> list[int]:
        """The blocks zeroed since the last call (which starts the record), for other ranks."""
        taken, self._zeroed = self._zeroed or [], []
        return taken

    def zero_blocks(self, blocks: list[int]) -> None:
        """Zero these blocks, as `allocate` does (a rank whose allocator is rank 0's)."""
        if blocks:
            self.pool.index_fill_(1, upload(blocks, torch.long, self.pool.device), 0)

    def free(self, blocks: list[int], owner: str) -> None:
        """Let go of blocks. A block nobody holds any more becomes free; one with a prefix key
        is kept (its KV intact) until allocation evicts it. Pass a sequence's blocks last to
        first, so that a prefix's tail is evicted before its head."""
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b]:
                continue
            self.used_by[owner] -= 1
            if not self.cache.release(b):
                self._free[b] = 1
                self.num_empty += 1

    def share(self, blocks: list[int], owner: str) -> None:
        """Hold blocks another sequence computed (a cached prefix from `PrefixCache.lookup`)."""
        for b in blocks:
            if self.refs[b] == 0:
                self.cache.hold(b)
                self.used_by[owner] += 1
            self.refs[b] += 1

    def num_unheld(self, blocks: list[int]) -> int:
        """How many of these blocks no sequence holds (sharing them takes them out of
        `num_free`)."""
        return sum(self.refs[b] == 0 for b in blocks)

    def bytes_used(self, owner: str) -> int:
        return self.used_by[owner] * self.block_bytes
