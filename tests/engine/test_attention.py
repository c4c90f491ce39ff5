"""Batched paged attention (one call per group per layer) equals a per-sequence reference."""

import random

import pytest
import torch
import torch.nn.functional as F

from engine.attention import VERIFY_MAX, PagedAttention, SeqSlice
from engine.cpu_attention import paged_attention
from engine.kv_cache import BlockPool

HEADS, KV_HEADS, D, LAYERS = 4, 2, 16, 2


def reference(cache_k, cache_v, seqs, q, scale):
    """The old engine's way: one SDPA per sequence over its keys gathered block by block."""
    out, start = torch.empty_like(q), 0
    for s in seqs:
        n = s.num_cached + s.num_query
        idx = torch.tensor(s.block_table)
        k = cache_k.index_select(0, idx).flatten(0, 1)[:n].transpose(0, 1)[None].float()
        v = cache_v.index_select(0, idx).flatten(0, 1)[:n].transpose(0, 1)[None].float()
        qq = q[start:start + s.num_query].transpose(0, 1)[None].float()
        mask = torch.arange(n)[None, :] <= torch.arange(s.num_cached, n)[:, None]
        o = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + s.num_query] = o[0].transpose(0, 1).to(q.dtype)
        start += s.num_query
    return out


def _pool(dtype, draft=False):
    target = (LAYERS, KV_HEADS, D)
    return BlockPool(2 << 20, target, 4, dtype, "cpu", (1, 1, D) if draft else None)


def _case(pool, layout, plan, rng, scattered):
    """plan: (cached, query) per sequence -> SeqSlices with blocks allocated (some scattered)."""
    tpb = layout.tokens_per_block
    seqs = []
    for cached, nq in plan:
        n = -(-(cached + nq) // tpb)
        blocks = pool.allocate(n, "target")
        if scattered and rng.random() < 0.5:
            rng.shuffle(blocks)
        seqs.append(SeqSlice(blocks, cached, nq))
    return seqs


PLANS = {
    "decode": [(9, 1), (1, 1), (30, 1), (17, 1)],
    "single_decode": [(21, 1)],
    "verify": [(9, 3), (12, 6), (5, 1), (30, 2)],
    "prefill": [(0, 7), (0, 25), (0, 1)],
    "mixed": [(0, 24), (8, 4), (13, 1), (4, 20), (2, 1), (3, 2)],
    "single_chunk": [(10, 9)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("layout", ["target", "draft"])
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_batched_equals_per_sequence(dtype, plan, layout, scattered, fused):
    rng = random.Random(hash((plan, layout, scattered)) % 1000)
    torch.manual_seed(0)
    pool = _pool(dtype, draft=layout == "draft")
    lay = pool.target if layout == "target" else pool.draft
    layers = pool.layers(lay)
    # Memory holds NaN before its blocks are handed out (as uninitialised memory or a stale NaN
    # may): attention must not read it, or (whole-block readers) must read it zeroed.
    pool.pool.fill_(float("nan"))
    seqs = _case(pool, lay, PLANS[plan], rng, scattered)
    for s in seqs:
        for pos in range(s.num_cached):
            b, o = s.block_table[pos // lay.tokens_per_block], pos % lay.tokens_per_block
            pool.view(lay)[b, :, :, o].normal_()           # every layer's K and V
    total = sum(s.num_query for s in seqs)
    scale = D ** -0.5
    attn = PagedAttention(layers, seqs, scale, {}, None, 0 if fused else None)
    # One call per query-length group, except prefill chunks starting fresh, which attend alone
    # to their own new keys.
    kinds = [0 if nq == 1 else 1 if nq <= VERIFY_MAX else 2 for _, nq in PLANS[plan]]
    long = [c for (c, _), kind in zip(PLANS[plan], kinds) if kind == 2]
    calls = (len({kind for kind in kinds if kind < 2}) + (len(long) > 1) * sum(c == 0 for c in long)
             + (1 if long and (len(long) == 1 or any(c > 0 for c in long)) else 0))
    assert len(attn.groups) == calls, plan
    if fused:      # every decode/verify group of several sequences runs the in-place kernel
        expect = sum(1 for kind in (0, 1) if kinds.count(kind) > 1) * (dtype == torch.float32)
        assert sum(g.fused for g in attn.groups) == expect, plan
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for layer in range(lay.num_layers):
        q = torch.randn(total, HEADS, D, dtype=dtype)
        k = torch.randn(total, lay.num_kv_heads, D, dtype=dtype)
        v = torch.randn(total, lay.num_kv_heads, D, dtype=dtype)
        out = attn(layer, q, k, v).view(total, HEADS, D)
        kc, vc = layers[layer]
        # The new keys were written where the sequence's positions say.
        start = 0
        for s in seqs:
            for j in range(s.num_query):
                pos = s.num_cached + j
                b, o = s.block_table[pos // lay.tokens_per_block], pos % lay.tokens_per_block
                assert torch.equal(kc[b, o], k[start + j]) and torch.equal(vc[b, o], v[start + j])
            start += s.num_query
        ref = reference(kc, vc, seqs, q, scale)
        assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol), plan
    assert paged_attention.failed is None       # the kernel built here: no silent fallback


def test_fused_kernel_only_where_the_gather_would_be_large():
    """With several threads the fused kernel takes a decode/verify group only once its gather
    would copy fused_min_bytes (below that, gather + SDPA in cache is faster); with one thread,
    always; prefill chunks and single sequences never."""
    pool = _pool(torch.float32)
    layers = pool.layers(pool.target)
    seqs = _case(pool, pool.target, [(30, 1)] * 4 + [(0, 20), (0, 30)], random.Random(0), False)
    gathered = 2 * 4 * 31 * KV_HEADS * D * 4           # K and V, 4 sequences padded to 31 keys

    def fused(min_bytes, one_thread=False, s=seqs):
        attn = PagedAttention(layers, s, D ** -0.5, {}, one_thread, min_bytes)
        return sorted((g.qmax, g.fused) for g in attn.groups)

    assert fused(gathered) == [(1, True), (20, False), (30, False)]
    assert fused(gathered + 1) == [(1, False), (20, False), (30, False)]
    assert fused(None) == [(1, False), (20, False), (30, False)]
    assert (1, True) in fused(gathered + 1, one_thread=True)      # one thread: always
    assert fused(0, s=seqs[:1]) == [(1, False)]                   # a single sequence: in place
    bf16 = _pool(torch.bfloat16)
    layers[:] = bf16.layers(bf16.target)
    seqs = _case(bf16, bf16.target, [(30, 1)] * 4, random.Random(0), False)
    assert fused(0, s=seqs) == [(1, False)]          # bf16 keeps SDPA (greedy identity)
