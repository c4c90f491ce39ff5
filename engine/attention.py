"""Attention over the paged KV cache, for one forward of one model over a ragged batch.

Owns: the per-forward metadata (where each new token's K/V goes, which cached blocks each query
sees), built once per forward as tensors and shared by all layers, and the attention call each
layer makes. Does not own: the model math (`models/llama.py`) or block allocation
(`engine/kv_cache.py`).

The pool is plane-major (`BlockPool.layers`): one layer's keys of all blocks are one array, so
a sequence's consecutive blocks are one contiguous run that attention streams
(docs/decisions/0002-kv-pool-layout.md).

Queries arrive flat, `[num_tokens, num_heads, head_dim]`, sequence after sequence. Sequences are
grouped by how many query tokens they bring (decode: 1; verify: 2..VERIFY_MAX; prefill chunks:
more), and each group is ONE attention call per layer. With `attention: fused` (the default;
CPU), every decode and verify group, a single sequence included, runs one fused kernel
(`engine/cpu_attention.py`) that reads its blocks in place through a block table and each row's
number of visible keys (key j is visible to query i of sequence b iff j <= cached_b + i). Otherwise the group's
blocks are copied (block by block, into a reused buffer) into a padded `[batch, keys]` view and
one batched SDPA runs with the same mask. A prompt chunk the scheduler marks (`prefill_align`)
runs apart, in pieces cut at fixed multiples, one SDPA call each (`_Prefill`: a prompt's KV
does not depend on where the load cut it); a first chunk attends to its own new keys and values
directly, reading nothing from the pool. Unmarked chunks (a draft's catch-up) are grouped by
length as above. With `flex` (GPUs by default, `paged_backend`), every decode and verify group
is one FlexAttention call per layer that reads the pool in place (`engine/flex_attention.py`);
prefill chunks keep SDPA.

Batch invariance, and why it decides the path: the projections are row-invariant (oneDNN, in
float32 and bfloat16), and so is the fused kernel, bit for bit; SDPA's CPU kernel blocks its
work by the number of queries and keys, so its rows move at the 1e-7 level with their
batch-mates. Greedy speculative output equals plain decoding token for token only when a token
verified among k others gets exactly what decoding it alone gives: with the fused kernel it
does, in both dtypes (tests); with SDPA it holds in float32 only as long as no 1e-7 move meets
a near-tie, and in bfloat16 such moves flip roundings (docs/decisions/0004-cpu-kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from engine.cpu_attention import paged_attention, write_kv
from engine.host_sync import upload

if TYPE_CHECKING:
    from engine.flex_attention import FlexPages

VERIFY_MAX = 17          # query tokens up to this are grouped with speculative verifies


@dataclass
class SeqSlice:
    """One sequence's part of a forward."""
    block_table: list[int]   # blocks holding this sequence's KV, in order
    num_cached: int          # tokens whose KV is already in the cache (positions 0..num_cached-1)
    num_query: int           # new tokens in this forward (positions num_cached..)
    prefill_align: int = 0   # > 0: a prompt chunk, attended in pieces cut at multiples of this
                             # (`_Prefill`); 0: decode, verify or a draft's catch-up


class _Gathers:
    """Copies the blocks of `self.blocks` ([batch, blocks]) out of the pool, `self.lk` keys."""

    def _keys_values(self, rows, k, v, k_cache, v_cache, workspace, compute):
        """(keys, values), each [batch, kv_heads, keys, d] in `compute`: where `self.fresh` (one
        sequence, nothing cached) its own new rows of k and v, else gathered from the pool."""
        if self.fresh:
            return (k[rows].transpose(0, 1)[None].to(compute),
                    v[rows].transpose(0, 1)[None].to(compute))
        return (self._gather(k_cache, workspace, "k", compute),
                self._gather(v_cache, workspace, "v", compute))

    def _gather(self, cache: torch.Tensor, workspace: dict | None, name: str,
                compute: torch.dtype) -> torch.Tensor:
        """cache [num_blocks, chunks, tokens_per_chunk, kv_heads, d] -> [b, kv_heads, lk, d] in
        `compute`: whole blocks copied into a reused buffer (a fresh one per layer would fault
        its pages in at every gather); in another dtype, then converted, whole blocks in their
        layout, into a second reused buffer (converting into the transposed layout SDPA reads
        contiguously costs more, and SDPA runs as fast on the strided view)."""
        n = self.blocks.numel()
        shape = (n, *cache.shape[1:])
        g = torch.index_select(cache, 0, self.blocks.flatten(),
                               out=_buffer(workspace, name, shape, cache.dtype, cache.device))
        if compute != cache.dtype:          # whole blocks, in their layout: one streaming pass
            g = _buffer(workspace, name + "_up", shape, compute, cache.device).copy_(g)
        return g.view(self.batch, -1, *cache.shape[-2:])[:, :self.lk].transpose(1, 2)


def query_rows(starts: list[int], num_cached: list[int], num_query: list[int], width: int,
               device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences whose num_query new tokens start at row starts[b] of the flat batch, each
    padded to `width` query rows (a pad repeats the sequence's last row): (rows [n, width], the
    keys each row sees [n, width] (query i of a sequence with num_cached tokens cached sees
    num_cached + i + 1))."""
    nq = upload(num_query, torch.long, device)
    i = torch.minimum(torch.arange(width, device=device)[None, :], (nq - 1)[:, None])
    rows = upload(starts, torch.long, device)[:, None] + i
    lens = upload(num_cached, torch.long, device)[:, None] + i + 1
    return rows, lens


def real_rows(num_query: list[int], width: int) -> list[int]:
    """The real (unpadded) rows of `query_rows`' [n, width], flat: computed on the host."""
    return [b * width + i for b, n in enumerate(num_query) for i in range(n)]


class _Group(_Gathers):
    """Sequences with similar query lengths, attended in one call per layer."""

    def __init__(self, members: list[int], seqs: list[SeqSlice], starts: list[int], tpb: int,
                 device, fused: bool = False):
        ss = [seqs[i] for i in members]
        lens, nq = [s.num_cached + s.num_query for s in ss], [s.num_query for s in ss]
        self.lk, self.qmax, self.batch, self.fused = max(lens), max(nq), len(ss), fused
        # A single sequence's first chunk: attention over its own new keys, nothing cached.
        self.fresh = len(ss) == 1 and ss[0].num_cached == 0
        # A single sequence attends through SDPA, or through the fused kernel as a batch of one.
        self.single = len(ss) == 1 and not fused
        if self.single:
            s = ss[0]
            self.rows = slice(starts[members[0]], starts[members[0]] + s.num_query)
            self.mask = None
            if not self.fresh and s.num_query > 1:
                self.mask = causal_from(s.num_cached, self.lk, device)
            if self.fresh:
                return
        # Each sequence's blocks, padded with its first: padded keys are masked, and a masked
        # slot holds a finite value (the pool zeroes the blocks it hands out), so weight 0 * v
        # is 0 whichever path reads it.
        nb = -(-self.lk // tpb)
        table = [s.block_table[:nb] + s.block_table[:1] * (nb - len(s.block_table[:nb])) for s in ss]
        self.blocks = upload(table, torch.long, device)
        if self.single:
            return
        # The kernel reads the pool at these ids unchecked: the highest is checked against the
        # pool's size per call (`_fused`), as torch's indexing checks it on the SDPA path.
        self.top = max(max(t) for t in table)
        # Query i of sequence b sees its keys 0 .. lens[b, i] - 1 (the fused kernel's form);
        # SDPA takes that as a mask over the longest sequence's keys.
        self.q_rows, self.lens = query_rows([starts[i] for i in members],
                                            [s.num_cached for s in ss], nq, self.qmax, device)
        self.q_index = self.q_rows.flatten()                         # [b * qmax]; pads repeat a row
        self.mask = None if fused else self._mask()
        if self.qmax == 1:
            self.valid, self.rows = None, self.q_index
        else:
            self.valid = upload(real_rows(nq, self.qmax), torch.long, device)
            self.rows = self.q_index[self.valid]

    def run(self, q, k, v, k_cache, v_cache, out, scale, workspace, compute) -> None:
        if self.single:
            keys, values = self._keys_values(self.rows, k, v, k_cache, v_cache, workspace, compute)
            query = q[self.rows].transpose(0, 1)[None].to(compute)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=self.mask,
                                               is_causal=self.fresh and self.qmax > 1, scale=scale,
                                               enable_gqa=True)
            out[self.rows] = o[0].transpose(0, 1)
            return
        if self.fused:
            if self._fused(q, k_cache, v_cache, out, scale):
                return
            self.fused, self.mask = False, self._mask()   # no kernel here: SDPA from now on
        query = q.index_select(0, self.q_index).view(self.batch, self.qmax, *q.shape[1:])
        o = F.scaled_dot_product_attention(query.transpose(1, 2).to(compute),
                                           self._gather(k_cache, workspace, "k", compute),
                                           self._gather(v_cache, workspace, "v", compute),
                                           attn_mask=self.mask, scale=scale, enable_gqa=True)
        o = o.transpose(1, 2).reshape(-1, *q.shape[1:]).to(q.dtype)       # [b * qmax, heads, d]
        if self.valid is not None:
            o = o.index_select(0, self.valid)
        out.index_copy_(0, self.rows, o)

    def _mask(self) -> torch.Tensor:
        """[b, 1, qmax, lk]: key j visible to query i of sequence b (SDPA's form of `lens`)."""
        j = torch.arange(self.lk, device=self.lens.device)
        return (j[None, None, :] < self.lens[:, :, None])[:, None]

    def _fused(self, q, k_cache, v_cache, out, scale) -> bool:
        """The group's rows of `out` from the fused kernel (it reads and writes them by their
        row numbers); False where it cannot run here."""
        if self.top >= k_cache.shape[0]:
            raise IndexError(f"block {self.top} outside a pool of {k_cache.shape[0]} blocks")
        return paged_attention(q, k_cache, v_cache, self.blocks, self.lens, self.q_rows, out, scale)


class _Prefill(_Gathers):
    """One sequence's prompt chunk, attended piece by piece: the pieces are cut at multiples of
    `prefill_align` from position 0, whatever the chunk, and each is one SDPA call over the
    keys up to its own end (the first, at position 0, causal over its own keys; later ones
    causal from the bottom right, `causal_from`). The scheduler cuts prompts only at those
    multiples (`engine/scheduler.py`), so a piece is the same call on the same inputs however
    the prompt was chunked and whatever ran beside it: a prompt's KV is the same bits under any
    load (tests/engine/test_prefill_cuts.py). SDPA's rows move with its number of queries and
    keys, so a chunk attended in one call would not be: the same prompt cut elsewhere gets other
    KV bits, and a near-tie later gives another greedy token
    (docs/decisions/0007-prefill-alignment.md)."""

    def __init__(self, s: SeqSlice, start: int, tpb: int, device):
        first, end, align = s.num_cached, s.num_cached + s.num_query, s.prefill_align
        self.fresh = first == 0          # keys and values all new: read from k, v, not the pool
        self.keys = slice(start - first, start - first + end)    # rows of positions 0..end
        self.pieces = []                 # (query rows, keys, mask)
        pos = first
        while pos < end:
            stop = min((pos // align + 1) * align, end)
            mask = causal_from(pos, stop, device) if pos > 0 else None
            self.pieces.append((slice(start + pos - first, start + stop - first), stop, mask))
            pos = stop
        if not self.fresh:
            self.batch, self.lk = 1, end
            self.blocks = torch.tensor([s.block_table[:-(-end // tpb)]], dtype=torch.long,
                                       device=device)

    def run(self, q, k, v, k_cache, v_cache, out, scale, workspace, compute) -> None:
        keys, values = self._keys_values(self.keys, k, v, k_cache, v_cache, workspace, compute)
        for rows, stop, mask in self.pieces:
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None].to(compute),
                                               keys[:, :, :stop], values[:, :, :stop],
                                               attn_mask=mask, is_causal=mask is None,
                                               scale=scale, enable_gqa=True)
            out[rows] = o[0].transpose(0, 1)


def causal_from(pos: int, stop: int, device):
    """The mask of queries at positions pos..stop-1 over keys 0..stop-1: query i sees keys
    0..pos + i, causal aligned to the bottom right. On CUDA as torch's bias object, which the
    flash kernel takes with grouped-query heads (a boolean mask sends SDPA to its math backend,
    every query x key score materialised); elsewhere as that boolean mask, made once a forward
    (the bias would be materialised at every layer's call; SDPA gives the same bits)."""
    if torch.device(device).type == "cuda":
        return causal_lower_right(stop - pos, stop)
    return (torch.arange(stop, device=device)[None, :]
            <= torch.arange(pos, stop, device=device)[:, None])


def _buffer(workspace: dict | None, name: str, shape, dtype, device) -> torch.Tensor:
    """A `shape` view of the workspace's buffer `name`, grown (or made) as needed."""
    size = 1
    for n in shape:
        size *= n
    buf = None if workspace is None else workspace.get(name)
    if buf is None or buf.numel() < size or buf.dtype != dtype:
        buf = torch.empty(size, dtype=dtype, device=device)
        if workspace is not None:
            workspace[name] = buf
    return buf[:size].view(shape)


def paged_backend(device: torch.device | str, attention: str) -> str:
    """The attention path a model runner takes for its decode and verify groups (prefill
    chunks always run SDPA): "fused", the CPU kernel (`EngineConfig.attention` "fused" on CPU;
    the runner falls back to "sdpa" where it cannot be built); "flex", FlexAttention over the
    pool in place ("fused" on a GPU, or asked for by name); "sdpa", gather + SDPA (asked for,
    or where FlexAttention is missing)."""
    from engine.flex_attention import missing        # (it imports this module)

    cpu = torch.device(device).type == "cpu"
    if attention == "sdpa" or (attention == "fused" and cpu):
        return attention
    return "sdpa" if missing() else "flex"


def token_major(device: torch.device | str, attention: str) -> bool:
    """Whether a pool serving `attention` on `device` is token-major (`BlockPool`): everywhere
    but under the CPU kernels, which read d-major keys."""
    return torch.device(device).type != "cpu" or paged_backend(device, attention) == "flex"


def _group_of(num_query: int) -> int:
    return 0 if num_query == 1 else 1 if num_query <= VERIFY_MAX else 2


def _kv_slots(blocks: list[int], offsets: list[int], per_chunk: int, device,
              pad: tuple[int, int] | None, flex) -> tuple[torch.Tensor, ...]:
    """Where each new token's KV goes: (block, chunk, row) tensors. Padded (`pad`), the padding
    tokens' go to the scratch block, through `flex`'s slot buffer."""
    if pad is None:
        blocks_t, offsets_t = upload([blocks, offsets], torch.long, device)
        return blocks_t, offsets_t // per_chunk, offsets_t % per_chunk
    extra = pad[0] - len(blocks)
    slots = flex.slots[:, :pad[0]]
    slots.copy_(upload([blocks + [pad[1]] * extra, [o // per_chunk for o in offsets] + [0] * extra,
                        [o % per_chunk for o in offsets] + [0] * extra], torch.long, device))
    return tuple(slots)


class PagedAttention:
    """The `attn(layer, q, k, v)` callable a model's forward uses for one batch.

    layers: per layer, (k_cache, v_cache), each [num_blocks, chunks, tokens_per_chunk, kv_heads,
    d] (`BlockPool.layers`).
    fused: every decode and verify group (single sequences too) runs the fused kernel
    (`engine/cpu_attention.py`, CPU), in any dtype; prefill chunks keep SDPA. False: gather +
    SDPA everywhere.
    """

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], seqs: list[SeqSlice],
                 scale: float, workspace: dict | None = None, fused: bool = False,
                 flex: FlexPages | None = None, pad: tuple[int, int] | None = None):
        """workspace: buffers kept by the caller across forwards (gathers reuse them).
        flex: decode and verify groups run FlexAttention over these pages
        (`engine/flex_attention.py`).
        pad: (num_tokens, scratch block): decode and verify sequences padded to num_tokens,
        whose padding writes its KV into the scratch block; every tensor read is one of `flex`'s
        buffers (a CUDA graph's fixed inputs, `engine/cuda_graphs.py`)."""
        self.layers, self.scale = layers, scale
        self.workspace = {} if workspace is None else workspace
        k_cache = layers[0][0]
        per_chunk, device = k_cache.shape[2], k_cache.device
        tpb = k_cache.shape[1] * per_chunk
        starts, blocks, offsets, groups, prefills = [], [], [], ([], [], []), []
        start = 0
        for i, s in enumerate(seqs):
            if s.num_query < 1:
                raise ValueError("every sequence in a forward brings at least one token")
            starts.append(start)
            t = s.block_table
            for pos in range(s.num_cached, s.num_cached + s.num_query):
                blocks.append(t[pos // tpb])
                offsets.append(pos % tpb)
            if s.prefill_align > 0:
                prefills.append(_Prefill(s, start, tpb, device))
            else:
                groups[_group_of(s.num_query)].append(i)
            start += s.num_query
        self.num_tokens = start
        # Why every decode and verify row goes through the one kernel when it is on: its output
        # for a row is a function of that row's query, keys and values alone, bit for bit,
        # whatever the batch, the padding or the number of query tokens beside it (test), so
        # a token verified in a speculative step gets exactly what decoding it alone gives, and
        # greedy speculative output equals plain decoding in bfloat16 too. SDPA's rows (and
        # torch's CPU matmuls) move with the batch shape (1e-7 in float32; in bfloat16 that
        # flips a rounding, and then a trained model's near-tie: docs/decisions/0004-cpu-kernels.md).
        if pad is not None and (prefills or groups[2] or flex is None or pad[0] <= start):
            raise ValueError("a padded forward takes decode and verify sequences through "
                             "FlexAttention, with at least one padding token")
        self.groups = prefills
        if flex is not None and (groups[0] or groups[1]):
            # Decode and verify together: one FlexAttention call a layer, decode rows padded to
            # the verifies' query count (the kernel reads each sequence's keys once for all
            # its rows); the group owns `flex`'s buffers for this forward.
            from engine.flex_attention import FlexGroup     # (it imports this module)

            g = groups[0] + groups[1]
            self.groups.append(FlexGroup(flex, [seqs[i].block_table for i in g],
                                         [seqs[i].num_cached for i in g],
                                         [seqs[i].num_query for i in g], [starts[i] for i in g],
                                         pad_row=None if pad is None else pad[0] - 1))
            groups = ([], [], groups[2])
        for g in filter(None, groups):
            if _group_of(seqs[g[0]].num_query) == 2 and len(g) > 1:
                # Prefill chunks: sequences starting fresh attend alone to their own new keys.
                fresh = [i for i in g if seqs[i].num_cached == 0]
                self.groups += [_Group([i], seqs, starts, tpb, device) for i in fresh]
                g = [i for i in g if seqs[i].num_cached > 0]
                if not g:
                    continue
            decode_or_verify = _group_of(seqs[g[0]].num_query) < 2
            self.groups.append(_Group(g, seqs, starts, tpb, device, fused and decode_or_verify))
        # Reduced precision on CPU: the SDPA path computes in float32 (keys and values converted
        # as they are gathered), its output rounded back: torch's CPU SDPA in bfloat16 runs
        # several times slower than in float32 on decode and verify shapes, conversion included
        # (docs/decisions/0004-cpu-kernels.md), and float32 scores are the more exact. CUDA
        # keeps the pool's dtype.
        self.compute = (torch.float32 if device.type == "cpu" and k_cache.dtype != torch.float32
                        else k_cache.dtype)
        self.padded = pad is not None
        self.slots = _kv_slots(blocks, offsets, per_chunk, device, pad, flex)
        # With the CPU kernels: each new token's element offset in every layer's views (they
        # share their strides), for `write_kv`; the highest block checked against the pool.
        self.offsets, self.top = None, max(blocks, default=0)
        if fused and device.type == "cpu":
            v_cache = layers[0][1]
            self.offsets = tuple(
                self.slots[0] * t.stride(0) + self.slots[1] * t.stride(1) + self.slots[2] * t.stride(2)
                for t in (k_cache, v_cache))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.layers[layer]
        if self.top >= k_cache.shape[0]:
            raise IndexError(f"block {self.top} outside a pool of {k_cache.shape[0]} blocks")
        if self.offsets is None or not write_kv(k, v, k_cache, v_cache, *self.offsets):
            k_cache.index_put_(self.slots, k)
            v_cache.index_put_(self.slots, v)
        # (a padded forward's padding rows are zeros, not whatever memory held: their values
        # reach the scratch block, which eager FlexAttention reads under a zero weight)
        out = torch.zeros_like(q) if self.padded else torch.empty_like(q)
        for g in self.groups:
            g.run(q, k, v, k_cache, v_cache, out, self.scale, self.workspace, self.compute)
        return out.flatten(1)
