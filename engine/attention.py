"""Attention over the paged KV cache, for one forward of one model over a ragged batch.

Owns: the per-forward metadata (where each new token's K/V goes, which cached tokens each query
sees) and the attention call each layer makes. Built once per forward, shared by all layers.
Does not own: the model math (`models/llama.py`) or block allocation (`engine/kv_cache.py`).

Queries arrive flat, `[num_tokens, num_heads, head_dim]`, sequence after sequence, and each
sequence is attended over exactly its own keys: nothing is padded to another sequence's length.
A sequence whose blocks are consecutive is read in place (a strided view of the pool); otherwise
its blocks are gathered first. (On a GPU a paged-attention kernel would do both in one call; on
this CPU path the per-sequence calls cost less than gathering into a padded batch.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SeqSlice:
    """One sequence's part of a forward."""
    block_table: list[int]   # blocks holding this sequence's KV, in order
    num_cached: int          # tokens whose KV is already in the cache (positions 0..num_cached-1)
    num_query: int           # new tokens in this forward (positions num_cached..)


class _Seq:
    """How one sequence reads its keys: in place (consecutive blocks) or gathered."""

    def __init__(self, s: SeqSlice, start: int, in_place: bool, device):
        self.tokens = slice(start, start + s.num_query)
        self.length = s.num_cached + s.num_query
        table = s.block_table
        first = table[0]
        self.window = None
        if in_place and table == list(range(first, first + len(table))):
            self.window = slice(first, first + len(table))
        else:
            self.blocks = torch.tensor(table, dtype=torch.long, device=device)
        self.mask, self.causal = None, False
        if s.num_query > 1 and s.num_cached == 0:
            self.causal = True
        elif s.num_query > 1:
            q_pos = torch.arange(s.num_cached, self.length, device=device)[:, None]
            self.mask = torch.arange(self.length, device=device)[None, :] <= q_pos  # [q, keys]

    def keys(self, cache: torch.Tensor) -> torch.Tensor:
        """cache [num_blocks, tokens_per_block, kv_heads, d] -> [1, kv_heads, length, d]."""
        blocks = cache[self.window] if self.window is not None else cache.index_select(0, self.blocks)
        return blocks.flatten(0, 1)[:self.length].transpose(0, 1)[None]

    def run(self, q, k_cache, v_cache, out, scale):
        query = q[self.tokens].transpose(0, 1)[None]                  # [1, heads, q, d]
        o = F.scaled_dot_product_attention(query, self.keys(k_cache), self.keys(v_cache),
                                           attn_mask=self.mask, is_causal=self.causal,
                                           scale=scale, enable_gqa=True)
        out[self.tokens] = o[0].transpose(0, 1)


class PagedAttention:
    """The `attn(layer, q, k, v)` callable a model's forward uses for one batch.

    layers: per layer, (k_cache, v_cache), each [num_blocks, tokens_per_block, kv_heads, d].
    """

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], seqs: list[SeqSlice],
                 scale: float, in_place: bool = True):
        self.layers, self.scale = layers, scale
        k_cache = layers[0][0]
        tpb, device = k_cache.shape[1], k_cache.device
        blocks, offsets, self.seqs = [], [], []
        start = 0
        for s in seqs:
            for pos in range(s.num_cached, s.num_cached + s.num_query):
                blocks.append(s.block_table[pos // tpb])
                offsets.append(pos % tpb)
            self.seqs.append(_Seq(s, start, in_place, device))
            start += s.num_query
        self.num_tokens = start
        self.slot_block = torch.tensor(blocks, dtype=torch.long, device=device)    # [num_tokens]
        self.slot_offset = torch.tensor(offsets, dtype=torch.long, device=device)  # [num_tokens]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.layers[layer]
        k_cache[self.slot_block, self.slot_offset] = k
        v_cache[self.slot_block, self.slot_offset] = v
        out = torch.empty_like(q)
        for s in self.seqs:
            s.run(q, k_cache, v_cache, out, self.scale)
        return out.flatten(1)
