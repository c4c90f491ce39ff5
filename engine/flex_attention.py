"""Paged decode and verify attention through PyTorch's FlexAttention: the kernel reads each
sequence's blocks where they lie in the pool, through a block mask, with no gather.

Owns: seeing one model's layers of the pool as FlexAttention's one long key sequence, the
per-forward block mask (which pages each sequence reads, which of them every query sees whole),
and the call. Does not own: grouping sequences (`engine/attention.py`), block allocation
(`engine/kv_cache.py`), or the pool's layout (token-major wherever this path runs:
`BlockPool(token_major=True)`).

The pool as one sequence. In a token-major pool one (layer, K or V) of a model is `chunks`
planes of `[num_blocks, tokens_per_chunk, num_kv_heads, head_dim]`, contiguous, so it is one
array of `chunks * num_blocks * tokens_per_chunk` token rows: FlexAttention's keys
`[1, num_kv_heads, slots, head_dim]`, broadcast over the batch. A *page* is one chunk of one
block, `tokens_per_chunk` rows: page `c * num_blocks + b` is chunk c of block b. A sequence's
logical page L (its tokens L * tokens_per_chunk ..) is chunk L % chunks of block
`block_table[L // chunks]`.

The block mask (`BlockMask`, KV_BLOCK_SIZE = one page; one query tile per sequence):
- `full_kv_indices[b]`: the pages every query row of sequence b sees whole (all but its last);
  the kernel applies no mask to them.
- `kv_indices[b]`: its last pages, which query rows see in part; `mask_mod` decides per key.
- `mask_mod(b, h, i, j)`: slot j is visible to query i of sequence b iff its page is logical page
  L of sequence b (`logical[b, page]`, -1 where b does not hold the page) and
  `L * tokens_per_chunk + j % tokens_per_chunk < lens[b, i]`, where query i of a sequence with
  `num_cached` tokens in the cache sees `num_cached + i + 1` keys. The rule is exact on every
  slot, so the result does not depend on which pages the mask lists beyond the ones needed
  (eager FlexAttention, the CPU tests' path, evaluates it everywhere).

Shapes are bucketed (batch to a power of two, query tokens to one of `QUERY_BUCKETS`: padded
rows repeat a real one and are dropped) and the metadata lives in buffers made once, the page
lists as wide as the pool, so a compiled kernel sees a few fixed shapes and the same tensors
every forward. Compiled (`torch.compile`) on CUDA; eager elsewhere (the dense reference, for
tests: it scores every slot of the pool). docs/decisions/0037-flex-attention-on-gpus.md.
"""

from __future__ import annotations

import warnings
from itertools import chain

import numpy as np
import torch

from engine.attention import query_rows, real_rows
from engine.host_sync import upload

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # torch < 2.5
    BlockMask = flex_attention = None

QUERY_BUCKETS = (1, 8, 32)   # query tokens per sequence are padded to one of these
# Shapes a compiled kernel is built for: batch buckets (powers of two up to max_num_seqs) x
# query buckets; dynamo's default of 8 recompiles a function would send the rest to eager
# FlexAttention, which scores every slot of the pool (out of memory on a GPU's pool).
RECOMPILE_LIMIT = 128


def missing() -> str | None:
    """Why FlexAttention cannot run here (None: it can)."""
    if flex_attention is None:
        return "torch has no FlexAttention (torch >= 2.5 needed)"
    return None


def pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1)."""
    return 1 << max(0, n - 1).bit_length()


def bucket(n: int, top: int) -> int:
    """pow2(n), at most `top` (but never below n)."""
    return min(pow2(n), max(top, n))


class FlexPages:
    """One model's pool layers as FlexAttention reads them, and the block mask's buffers.

    layers: per layer (K, V), each [num_blocks, chunks, tokens_per_chunk, kv_heads, d], views
    of a token-major pool (`BlockPool.layers`); max_batch: the most sequences in one group;
    group: query heads per KV head.

    Compiled, every call must take torch's decode kernel (query tokens < 128, the batch and
    heads static, one block-mask head): its tiles shrink to a 16-token page, while the general
    kernel's need pages of 32 or more. That kernel packs a KV head's query heads into one tile,
    so `group` must be a power of two, and a tile of query rows (query tokens x group, at least
    16) must divide the block mask's query block (`q_block`)."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], max_batch: int,
                 compiled: bool, group: int = 1):
        if compiled and group & (group - 1):
            raise ValueError(f"{group} query heads per KV head: the compiled decode kernel "
                             f"packs a power of two")
        self.group = group
        k0 = layers[0][0]
        self.num_blocks, self.chunks, self.per_page = k0.shape[:3]
        self.num_pages = self.num_blocks * self.chunks
        self.device = k0.device
        # each layer's K and V view, by its address (what a group's `run` is handed)
        self.sequences = {t.data_ptr(): _as_sequence(t) for kv in layers for t in kv}
        self.max_batch = max_batch
        b, p, i32 = self.max_batch, self.num_pages, torch.int32
        self.logical = torch.full((b, p), -1, dtype=i32, device=self.device)   # [batch, pages]
        self.lens = torch.zeros(b, QUERY_BUCKETS[-1], dtype=i32, device=self.device)
        self.partial = torch.zeros(b, 1, 1, p, dtype=i32, device=self.device)
        self.full = torch.zeros(b, 1, 1, p, dtype=i32, device=self.device)
        self.counts = torch.zeros(2, b, 1, 1, dtype=i32, device=self.device)  # full, partial
        # query rows in, rows kept, rows of `out` they go to (a CUDA graph reads these)
        rows = b * QUERY_BUCKETS[-1]
        self.q_index, self.take, self.rows = torch.zeros(3, rows, dtype=torch.long,
                                                         device=self.device)
        # the KV write's (block, chunk, row) per token of a padded forward (`PagedAttention`)
        self.slots = torch.zeros(3, rows + 1, dtype=torch.long, device=self.device)
        per_page, logical, lens = self.per_page, self.logical, self.lens

        def visible(b, h, q_idx, kv_idx):
            page_of = logical[b, kv_idx // per_page]
            return (page_of >= 0) & (page_of * per_page + kv_idx % per_page < lens[b, q_idx])

        self.mask_mod = visible
        self.attend = _eager
        if compiled:
            from torch import _dynamo

            cfg = _dynamo.config
            cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
            self.attend = torch.compile(flex_attention, dynamic=False)

    def q_block(self, qlen: int) -> int:
        """The block mask's query block for `qlen` query tokens a sequence: 128, or the decode
        kernel's query tile (qlen x group rounded up to a power of two) where that is larger."""
        return max(128, pow2(qlen * self.group))

    def sequence_of(self, cache: torch.Tensor) -> torch.Tensor:
        """[1, kv_heads, slots, d]: the pool view `cache` (one layer's K or V) as one sequence."""
        return self.sequences[cache.data_ptr()]


def _eager(*args, **kwargs):
    """FlexAttention without compiling: the dense reference (torch warns that it is one)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


def _padded(tables: list[list[int]], width: int) -> np.ndarray:
    """[len(tables), width] int64: each table's first `width` entries, 0 past its end. Built
    through numpy's fromiter, which is several times faster than padded lists through
    torch.tensor at a GPU's batch sizes (docs/decisions/0037)."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    flat = np.fromiter(chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))
    starts = np.cumsum(lens) - lens
    j = np.arange(width)
    return np.where(j < lens[:, None], flat[starts[:, None] + np.minimum(j, lens[:, None] - 1)], 0)


def _upload(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Host tensors of one dtype to `device` in one copy, as views of their shapes."""
    flat = upload(torch.cat([t.reshape(-1) for t in tensors]), tensors[0].dtype, device)
    return [part.view(t.shape) for part, t in
            zip(flat.split([t.numel() for t in tensors]), tensors)]


def _as_sequence(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, chunks, tokens_per_chunk, kv_heads, d] (token-major planes) ->
    [1, kv_heads, chunks * num_blocks * tokens_per_chunk, d], a view: page c * num_blocks + b."""
    planes = cache.permute(1, 0, 2, 3, 4)
    if not planes.is_contiguous():
        raise ValueError("FlexAttention reads a token-major pool whose plane runs hold whole "
                         "chunks (BlockPool(token_major=True), a draft that fills its planes)")
    return planes.reshape(-1, *cache.shape[-2:]).transpose(0, 1)[None]


class FlexGroup:
    """Decode or verify sequences of one forward, attended in one FlexAttention call per layer.

    Same interface as `engine.attention._Group`: `run(q, k, v, k_cache, v_cache, out, scale,
    workspace, compute)` writes the group's rows of `out` [num_tokens, heads, d]. The metadata
    is computed on the host from the sequences' block tables and sent in two copies (its
    32-bit and its 64-bit tensors)."""

    def __init__(self, pages: FlexPages, block_tables: list[list[int]], num_cached: list[int],
                 num_query: list[int], starts: list[int], pad_row: int | None = None):
        """pad_row: the rows kept are padded to batch x qlen (a CUDA graph's fixed shape, the
        pads copying row 0 of the output into row `pad_row` of `out`, a padding token's)."""
        self.pages = pages
        n, dev, i32 = len(block_tables), pages.device, torch.int32
        self.batch = bucket(n, pages.max_batch)
        qmax = max(num_query)
        self.qlen = next((b for b in QUERY_BUCKETS if b >= qmax), qmax)
        if self.batch > pages.max_batch or self.qlen > QUERY_BUCKETS[-1]:
            raise ValueError(f"a FlexAttention group of {n} sequences x {qmax} queries exceeds "
                             f"{pages.max_batch} x {QUERY_BUCKETS[-1]}")
        c, pp = pages.chunks, pages.per_page
        q_index, keys_seen = query_rows(starts, num_cached, num_query, self.qlen)
        # the metadata, on the host (numpy), then sent in two copies
        cached, nq = np.asarray(num_cached), np.asarray(num_query)     # [n]
        total = -(-(cached + nq) // pp)                                # [n] pages read
        full = (cached + 1) // pp                                      # [n] seen whole by all
        width = int(total.max())
        nb = -(-width // c)
        table = _padded(block_tables, nb)                              # [n, nb]
        # logical page L of sequence b is chunk L % c of block block_table[L // c]
        page = (table[:, :, None] + np.arange(c) * pages.num_blocks).reshape(n, -1)[:, :width]
        L = np.broadcast_to(np.arange(width)[None, :], (n, width))
        held = L < total[:, None]                                      # [n, width]
        slot = (np.arange(n)[:, None] * pages.num_pages + page)[held]
        front = np.minimum(full[:, None] + L, np.maximum(total - 1, 0)[:, None])
        meta = np.zeros((4, self.batch, width), dtype=np.int32)
        meta[0, :n] = np.where(L < full[:, None], page, 0)             # full pages, in order
        meta[1, :n] = np.take_along_axis(page, front, 1)               # partial ones, in front
        meta[2, :n, 0], meta[3, :n, 0] = full, total - full            # their counts
        lens = torch.zeros(self.batch, self.qlen, dtype=i32)
        lens[:n] = keys_seen
        # query rows [batch * qlen] (padded sequences repeat row q_index[0, 0]); rows kept
        pad = q_index[:1, :1].expand(self.batch - n, self.qlen)
        take = torch.tensor(real_rows(num_query, self.qlen))            # into [n * qlen]
        rows = q_index.flatten()[take]
        kept = take.numel() if pad_row is None else self.batch * self.qlen
        if pad_row is not None:
            take = torch.cat([take, torch.zeros(kept - take.numel(), dtype=torch.long)])
            rows = torch.cat([rows, torch.full((kept - rows.numel(),), pad_row)])
        meta, lens, values = _upload([torch.from_numpy(meta), lens,
                                      torch.from_numpy(L[held].astype(np.int32))], dev)
        slot, q_rows, take, rows = _upload(
            [torch.from_numpy(slot), torch.cat([q_index, pad]).flatten(), take, rows], dev)
        # Every tensor a forward reads lives in `pages`' buffers, rewritten in place: a compiled
        # kernel and a captured CUDA graph read the same addresses every time.
        self.q_index = pages.q_index[:self.batch * self.qlen]
        self.take, self.rows = pages.take[:kept], pages.rows[:kept]
        for buf, src in ((self.q_index, q_rows), (self.take, take), (self.rows, rows)):
            buf.copy_(src)
        pages.logical[:self.batch].fill_(-1)
        pages.logical.view(-1).index_put_((slot,), values)
        pages.lens[:self.batch, :self.qlen] = lens
        # (past each count the lists hold stale pages: no kernel reads them)
        full_buf, part_buf = pages.full[:self.batch], pages.partial[:self.batch]
        full_buf[:, 0, 0, :width] = meta[0]
        part_buf[:, 0, 0, :width] = meta[1]
        counts = pages.counts[:, :self.batch]
        counts[:, :, 0, 0] = meta[2:, :, 0]
        self.block_mask = BlockMask.from_kv_blocks(
            counts[1], part_buf, counts[0],
            full_buf, BLOCK_SIZE=(pages.q_block(self.qlen), pp), mask_mod=pages.mask_mod,
            seq_lengths=(self.qlen, pages.num_pages * pp), compute_q_blocks=False)

    def run(self, q, k, v, k_cache, v_cache, out, scale, workspace, compute) -> None:
        p = self.pages
        keys, values = p.sequence_of(k_cache), p.sequence_of(v_cache)
        query = q.index_select(0, self.q_index).view(self.batch, self.qlen, *q.shape[1:])
        o = p.attend(query.transpose(1, 2).contiguous(), keys, values, block_mask=self.block_mask,
                     scale=scale, enable_gqa=True)
        o = o.transpose(1, 2).reshape(-1, *q.shape[1:])               # [batch * qlen, heads, d]
        out.index_copy_(0, self.rows, o.index_select(0, self.take).to(out.dtype))
