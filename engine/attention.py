"""Attention over the paged KV cache, for one forward of one model over a ragged batch.

Owns: the per-forward metadata (where each new token's K/V goes, which cached tokens each query
sees), built once per forward as tensors and shared by all layers, and the attention call each
layer makes. Does not own: the model math (`models/llama.py`) or block allocation
(`engine/kv_cache.py`).

Queries arrive flat, `[num_tokens, num_heads, head_dim]`, sequence after sequence. Sequences are
grouped by how many query tokens they bring (decode: 1; verify: 2..VERIFY_MAX; prefill chunks:
more), and each group is ONE attention call per layer: its sequences' keys are gathered from the
pool through a token table into a padded `[batch, max_len]` view and one batched SDPA runs with a
per-row mask (key j is visible to query i of sequence b iff j <= cached_b + i). A group of ONE
sequence whose blocks are consecutive reads its keys in place (a strided view of the pool, no
gather), which is what a single stream pays. On CPU, decode and verify groups of several
sequences skip the gather: one fused kernel (`engine/cpu_attention.py`) reads the keys in place
through the same token table and mask. Prefill chunks keep SDPA (compute, not the copy, is
their cost). CUDA runs the gather + SDPA path; a paged-attention library is not wired in yet.

Batch invariance: SDPA's CPU kernel blocks its work by the number of queries and keys, so a
row's output moves at the 1e-7 level (float32) with its batch-mates' lengths and with being a
decode or a verify row (it did before batching too, between decode and verify). The projections
are row-invariant (oneDNN), so greedy speculative output still equals plain decoding (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.cpu_attention import paged_attention

VERIFY_MAX = 17          # query tokens up to this are grouped with speculative verifies


@dataclass
class SeqSlice:
    """One sequence's part of a forward."""
    block_table: list[int]   # blocks holding this sequence's KV, in order
    num_cached: int          # tokens whose KV is already in the cache (positions 0..num_cached-1)
    num_query: int           # new tokens in this forward (positions num_cached..)


class _Group:
    """Sequences with similar query lengths, attended in one call per layer."""

    def __init__(self, members: list[int], seqs: list[SeqSlice], starts: list[int], tpb: int,
                 flat: bool, in_place: bool, device, fused: bool = False):
        ss = [seqs[i] for i in members]
        self.window, self.causal, self.mask, self.batch = None, False, None, 0
        self.fused = False
        lens = [s.num_cached + s.num_query for s in ss]
        self.lk, nq = max(lens), [s.num_query for s in ss]
        self.qmax = max(nq)
        if len(ss) == 1:                      # one sequence: no padding, in place if it can be
            s, t = ss[0], ss[0].block_table
            self.rows = slice(starts[members[0]], starts[members[0]] + s.num_query)
            if in_place and _consecutive(t):
                self.window = slice(t[0], t[0] + len(t))
            if s.num_query > 1 and s.num_cached == 0:
                self.causal = True
            elif s.num_query > 1:
                q_pos = torch.arange(s.num_cached, self.lk, device=device)[:, None]
                self.mask = torch.arange(self.lk, device=device)[None, :] <= q_pos
            if self.window is not None:
                return
        maxb = -(-self.lk // tpb)
        table = torch.tensor([s.block_table[:maxb] + [0] * (maxb - len(s.block_table[:maxb]))
                              for s in ss], dtype=torch.long, device=device)
        j = torch.arange(self.lk, device=device)
        # Keys past a sequence's length are masked, but 0 * NaN is NaN: they read the sequence's
        # own first token (always written) rather than slots that may never have been written.
        lens_t = torch.tensor(lens, dtype=torch.long, device=device)
        jj = torch.where(j[None, :] < lens_t[:, None], j[None, :], 0)    # [b, lk]
        blk = table.gather(1, jj // tpb)
        if flat:                                                     # token index into the pool
            self.keys = (blk * tpb + jj % tpb).flatten()
        else:
            self.keys = (blk.flatten(), (jj % tpb).flatten())
        if len(ss) == 1:
            return                            # rows and causal/mask were set above
        self.batch = len(ss)
        self.fused = fused and flat and self.qmax <= VERIFY_MAX
        start = torch.tensor([starts[i] for i in members], dtype=torch.long, device=device)
        nq_t = torch.tensor(nq, dtype=torch.long, device=device)
        cached = torch.tensor([s.num_cached for s in ss], dtype=torch.long, device=device)
        i = torch.minimum(torch.arange(self.qmax, device=device)[None, :], (nq_t - 1)[:, None])
        self.q_index = (start[:, None] + i).flatten()                # [b * qmax]; pads repeat a row
        self.mask = (j[None, None, :] <= (cached[:, None] + i)[:, :, None])[:, None]  # [b,1,q,lk]
        if self.qmax == 1:
            self.valid, self.rows = None, self.q_index
        else:
            valid = torch.arange(self.qmax, device=device)[None, :] < nq_t[:, None]
            self.valid = valid.flatten().nonzero().squeeze(1)
            self.rows = self.q_index[self.valid]

    def _gather(self, cache: torch.Tensor, workspace: dict | None, name: str) -> torch.Tensor:
        """cache [num_blocks, tpb, kv_heads, d] -> [b, kv_heads, lk, d], into a reused buffer
        (a fresh one per layer costs page faults: 2.7 against 1.45 ms a gather at batch 32)."""
        if isinstance(self.keys, tuple):
            g = cache[self.keys]
        else:
            n = self.keys.numel()
            shape = (n, *cache.shape[2:])
            buf = None if workspace is None else workspace.get(name)
            if buf is None or buf.numel() < n * shape[1] * shape[2] or buf.dtype != cache.dtype:
                buf = torch.empty(n * shape[1] * shape[2], dtype=cache.dtype, device=cache.device)
                if workspace is not None:
                    workspace[name] = buf
            g = torch.index_select(cache.flatten(0, 1), 0, self.keys,
                                   out=buf[:n * shape[1] * shape[2]].view(shape))
        return g.view(-1, self.lk, *cache.shape[2:]).transpose(1, 2)

    def run(self, q, k_cache, v_cache, out, scale, workspace) -> None:
        if not self.batch:
            if self.window is not None:
                k = k_cache[self.window].flatten(0, 1)[:self.lk].transpose(0, 1)[None]
                v = v_cache[self.window].flatten(0, 1)[:self.lk].transpose(0, 1)[None]
            else:
                k, v = self._gather(k_cache, workspace, "k"), self._gather(v_cache, workspace, "v")
            query = q[self.rows].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(query, k, v, attn_mask=self.mask,
                                               is_causal=self.causal, scale=scale, enable_gqa=True)
            out[self.rows] = o[0].transpose(0, 1)
            return
        o = self._fused(q, k_cache, v_cache, scale) if self.fused else None
        if o is not None:
            if self.valid is not None:
                o = o.index_select(0, self.valid)
            out.index_copy_(0, self.rows, o)
            return
        query = q.index_select(0, self.q_index).view(self.batch, self.qmax, *q.shape[1:])
        o = F.scaled_dot_product_attention(query.transpose(1, 2),
                                           self._gather(k_cache, workspace, "k"),
                                           self._gather(v_cache, workspace, "v"), attn_mask=self.mask,
                                           scale=scale, enable_gqa=True)
        o = o.transpose(1, 2).reshape(-1, *q.shape[1:])             # [b * qmax, heads, d]
        if self.valid is not None:
            o = o.index_select(0, self.valid)
        out.index_copy_(0, self.rows, o)


    def _fused(self, q, k_cache, v_cache, scale) -> torch.Tensor | None:
        """[b * qmax, heads, d] from the fused kernel, or None where it cannot run here."""
        kv_heads, d = k_cache.shape[2], k_cache.shape[3]
        query = q.index_select(0, self.q_index).view(self.batch, self.qmax, kv_heads, -1, d)
        o = paged_attention(query, k_cache.flatten(0, 1), v_cache.flatten(0, 1),
                            self.keys.view(self.batch, self.lk), self.mask[:, 0], scale)
        return None if o is None else o.view(-1, *q.shape[1:])


def _gather_bytes(k_cache: torch.Tensor, seqs: list[SeqSlice]) -> int:
    """Bytes the gather path would copy for these sequences' keys and values (one layer)."""
    lk = max(s.num_cached + s.num_query for s in seqs)
    return 2 * len(seqs) * lk * k_cache[0, 0].numel() * k_cache.element_size()


def _consecutive(table: list[int]) -> bool:
    return table == list(range(table[0], table[0] + len(table)))


def _group_of(num_query: int) -> int:
    return 0 if num_query == 1 else 1 if num_query <= VERIFY_MAX else 2


class PagedAttention:
    """The `attn(layer, q, k, v)` callable a model's forward uses for one batch.

    layers: per layer, (k_cache, v_cache), each [num_blocks, tokens_per_block, kv_heads, d].
    in_place: consecutive blocks are evenly strided (a sequence's keys are a strided view, and
    the pool's tokens of one layer are a flat strided view).
    fused_min_bytes: None: never the fused kernel. Else decode and verify groups of several
    sequences in a float32 pool run the fused in-place kernel (CPU) when their gather would copy at least this many
    bytes, or whenever torch has one thread (it then beats per-sequence calls at any batch).
    """

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], seqs: list[SeqSlice],
                 scale: float, in_place: bool = True, workspace: dict | None = None,
                 per_sequence: bool | None = None, fused_min_bytes: int | None = None):
        """workspace: buffers kept by the caller across forwards (gathers reuse them).
        per_sequence: attend in-place sequences one by one (None: when torch has one thread)."""
        self.layers, self.scale = layers, scale
        self.workspace = {} if workspace is None else workspace
        k_cache = layers[0][0]
        tpb, device = k_cache.shape[1], k_cache.device
        # One layer's tokens as a flat strided view (so slots and key tables are token indices).
        self.flat = in_place and k_cache.stride(0) == tpb * k_cache.stride(1)
        starts, blocks, offsets, groups = [], [], [], ([], [], [])
        start = 0
        for i, s in enumerate(seqs):
            if s.num_query < 1:
                raise ValueError("every sequence in a forward brings at least one token")
            starts.append(start)
            t = s.block_table
            for pos in range(s.num_cached, s.num_cached + s.num_query):
                blocks.append(t[pos // tpb])
                offsets.append(pos % tpb)
            groups[_group_of(s.num_query)].append(i)
            start += s.num_query
        self.num_tokens = start
        # With one thread, sequences whose blocks are consecutive are attended one by one in
        # place: gathering them costs more than the calls it saves (batch-32 decode forward,
        # CPU time: 100-110 ms per sequence against 116-123 ms batched). With more threads every
        # call is a parallel region, and one batched call per layer wins (450-475 ms of CPU
        # against 1,200-1,500 here, on a loaded machine).
        # float32 only: in bfloat16 the fused kernel's rounding differs from SDPA's (which rounds
        # the probabilities to bf16 before the product with V), enough to flip a near-tie argmax
        # between a sequence decoded alone (SDPA in place) and in a batch; greedy speculative
        # output must equal plain decoding token for token. (bf16 is not the fast path on CPUs
        # without native bf16, where dtype "auto" picks float32.)
        fused_dtype = k_cache.dtype == torch.float32
        one_thread = per_sequence if per_sequence is not None else (
            device.type == "cpu" and torch.get_num_threads() == 1)
        self.groups = []
        for g in filter(None, groups):
            if (fused_min_bytes is not None and self.flat and len(g) > 1 and fused_dtype
                    and _group_of(seqs[g[0]].num_query) < 2
                    and (one_thread or _gather_bytes(k_cache, [seqs[i] for i in g]) >= fused_min_bytes)):
                self.groups.append(_Group(g, seqs, starts, tpb, self.flat, in_place, device, True))
            elif one_thread and in_place and all(_consecutive(seqs[i].block_table) for i in g):
                self.groups += [_Group([i], seqs, starts, tpb, self.flat, in_place, device) for i in g]
            else:
                self.groups.append(_Group(g, seqs, starts, tpb, self.flat, in_place, device))
        block = torch.tensor(blocks, dtype=torch.long, device=device)
        offset = torch.tensor(offsets, dtype=torch.long, device=device)
        self.slots = block * tpb + offset if self.flat else (block, offset)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.layers[layer]
        if self.flat:
            k_cache.flatten(0, 1).index_copy_(0, self.slots, k)
            v_cache.flatten(0, 1).index_copy_(0, self.slots, v)
        else:
            k_cache.index_put_(self.slots, k)
            v_cache.index_put_(self.slots, v)
        out = torch.empty_like(q)
        for g in self.groups:
            g.run(q, k_cache, v_cache, out, self.scale, self.workspace)
        return out.flatten(1)
