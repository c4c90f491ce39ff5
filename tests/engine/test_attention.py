"""Batched paged attention (one call per group per layer) equals a per-sequence reference."""

import random

import pytest
import torch
import torch.nn.functional as F

from engine.attention import VERIFY_MAX, PagedAttention, SeqSlice, causal_from
from engine.cpu_attention import paged_attention
from engine.kv_cache import BlockPool

HEADS, KV_HEADS, D, LAYERS = 4, 2, 16, 2


def reference(cache_k, cache_v, seqs, q, scale):
    """The old engine's way: one SDPA per sequence over its keys gathered block by block."""
    out, start = torch.empty_like(q), 0
    for s in seqs:
        n = s.num_cached + s.num_query
        idx = torch.tensor(s.block_table)
        k = cache_k.index_select(0, idx).flatten(0, 2)[:n].transpose(0, 1)[None].float()
        v = cache_v.index_select(0, idx).flatten(0, 2)[:n].transpose(0, 1)[None].float()
        qq = q[start:start + s.num_query].transpose(0, 1)[None].float()
        mask = torch.arange(n)[None, :] <= torch.arange(s.num_cached, n)[:, None]
        o = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:start + s.num_query] = o[0].transpose(0, 1).to(q.dtype)
        start += s.num_query
    return out


def _pool(dtype, draft=None):
    """draft: None, "shallow" (1 layer: its (layer, K/V) spans 2 of the 4 planes) or "deep"
    (3 layers: 12 planes, so each target (layer, K/V) spans 3 chunks)."""
    target = (LAYERS, KV_HEADS, D)
    shape = {None: None, "shallow": (1, 1, D), "deep": (3, 1, D)}[draft]
    return BlockPool(2 << 20, target, 4, dtype, "cpu", shape)


def _row(cache, block, offset):
    """Token `offset` of `block` in one layer's [num_blocks, chunks, per_chunk, heads, d] view."""
    return cache[block, offset // cache.shape[2], offset % cache.shape[2]]


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
@pytest.mark.parametrize("layout", ["target", "draft", "chunked"])
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_batched_equals_per_sequence(dtype, plan, layout, scattered, fused):
    rng = random.Random(hash((plan, layout, scattered)) % 1000)
    torch.manual_seed(0)
    pool = _pool(dtype, draft={"target": None, "draft": "shallow", "chunked": "deep"}[layout])
    lay = pool.draft if layout == "draft" else pool.target
    layers = pool.layers(lay)
    # Memory holds NaN before its blocks are handed out (as uninitialised memory or a stale NaN
    # may): attention must not read it, or (whole-block readers) must read it zeroed.
    pool.pool.fill_(float("nan"))
    seqs = _case(pool, lay, PLANS[plan], rng, scattered)
    for s in seqs:
        for pos in range(s.num_cached):
            b, o = s.block_table[pos // lay.tokens_per_block], pos % lay.tokens_per_block
            for kc, vc in layers:                          # every layer's K and V
                _row(kc, b, o).normal_(), _row(vc, b, o).normal_()
    total = sum(s.num_query for s in seqs)
    scale = D ** -0.5
    attn = PagedAttention(layers, seqs, scale, {}, fused=fused)
    # One call per query-length group, except prefill chunks starting fresh, which attend alone
    # to their own new keys.
    kinds = [0 if nq == 1 else 1 if nq <= VERIFY_MAX else 2 for _, nq in PLANS[plan]]
    long = [c for (c, _), kind in zip(PLANS[plan], kinds) if kind == 2]
    calls = (len({kind for kind in kinds if kind < 2}) + (len(long) > 1) * sum(c == 0 for c in long)
             + (1 if long and (len(long) == 1 or any(c > 0 for c in long)) else 0))
    assert len(attn.groups) == calls, plan
    # fused: every decode and verify group (a single sequence too, any dtype) runs the kernel
    expect = sum(1 for kind in (0, 1) if kind in kinds) if fused else 0
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
                assert torch.equal(_row(kc, b, o), k[start + j])
                assert torch.equal(_row(vc, b, o), v[start + j])
            start += s.num_query
        ref = reference(kc, vc, seqs, q, scale)
        assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol), plan
    assert paged_attention.failed is None       # the kernel built here: no silent fallback


def test_fused_takes_every_decode_and_verify_group_and_no_prefill():
    """With the kernel on, decode and verify groups run it whatever their size (one sequence
    included) and dtype; prefill chunks keep SDPA. Off: SDPA everywhere."""
    for dtype in (torch.float32, torch.bfloat16):
        pool = _pool(dtype)
        layers = pool.layers(pool.target)
        plan = [(30, 1)] * 4 + [(9, 3), (0, 20), (0, 30), (8, 20)]
        seqs = _case(pool, pool.target, plan, random.Random(0), False)

        def groups(fused, s=seqs):
            return sorted((g.qmax, g.fused) for g in PagedAttention(layers, s, D ** -0.5, {}, fused=fused).groups)

        assert groups(True) == [(1, True), (3, True), (20, False), (20, False), (30, False)]
        assert groups(False) == [(1, False), (3, False), (20, False), (20, False), (30, False)]
        assert groups(True, seqs[:1]) == [(1, True)]
        assert groups(True, seqs[4:5]) == [(3, True)]


@pytest.fixture
def threads(request):
    """The kernel run at this many threads (it splits its work between threads by sequence and
    head only, so no sum may move with the count); the suite's one thread restored after."""
    n = request.param
    torch.set_num_threads(n)
    yield n
    torch.set_num_threads(1)


def _kernel_case(dtype, b, nq, heads, kv_heads, d, block, draft, rng):
    """The kernel's inputs over an engine pool (a draft's shape beside the target makes blocks
    of several chunks): scattered blocks, each row seeing its own number of keys."""
    pool = BlockPool(16 << 20, (2, kv_heads, d), block, dtype, "cpu", draft)
    k_cache, v_cache = pool.layers(pool.target)[1]
    pool.pool.normal_()
    tpb = pool.target.tokens_per_block
    nb = rng.randrange(1, 6)
    blocks = torch.tensor([rng.sample(range(pool.num_blocks), nb) for _ in range(b)])
    lens = torch.tensor([[rng.randrange(1, nb * tpb + 1) for _ in range(nq)] for _ in range(b)])
    q = torch.randn(b, nq, kv_heads, heads // kv_heads, d).to(dtype)
    return q, k_cache, v_cache, blocks, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d,block,draft", [
    (4, 2, 16, 4, None),             # GQA, blocks narrower than a vector: every chunk a tail
    (3, 3, 24, 16, (3, 1, 24)),      # a head size no multiple of the vector width; 3 chunks
    (5, 5, 64, 16, None),            # reference-py's
    (8, 1, 64, 40, None)])           # 8 query heads a KV head: rows past the registers' count
def test_the_kernel_equals_its_reference(dtype, heads, kv_heads, d, block, draft):
    """The C++ kernel against the same math in torch ops (`_paged`), over decode, verify and
    long verify rows, batches of one and several, any number of visible keys a row."""
    from engine.cpu_attention import _paged
    rng = random.Random(7)
    torch.manual_seed(7)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for b, nq in [(1, 1), (3, 1), (2, 5), (4, 3), (1, 17)]:
        q, k, v, blocks, lens = _kernel_case(dtype, b, nq, heads, kv_heads, d, block, draft, rng)
        # token rows of q and out: shuffled, among rows no query uses (left untouched)
        rows = torch.randperm(b * nq + 3)[:b * nq]
        flat = torch.randn(b * nq + 3, heads, d).to(dtype)
        flat[rows] = q.view(b * nq, heads, d)
        out = torch.full_like(flat, 7.0)
        assert paged_attention(flat, k, v, blocks, lens, rows.view(b, nq), out, d ** -0.5)
        ref = _paged(q, k, v, blocks, lens, d ** -0.5).reshape(b * nq, heads, d)
        assert torch.allclose(out[rows].float(), ref.float(), atol=tol, rtol=tol), (b, nq)
        untouched = torch.ones(b * nq + 3, dtype=torch.bool)
        untouched[rows] = False
        assert (out[untouched] == 7.0).all()
    assert paged_attention.failed is None


def test_the_kernel_refuses_a_pool_laid_out_otherwise():
    """The kernel reads raw memory by the pool's strides: keys laid out token-major instead of
    d-major are refused, not misread."""
    q = torch.randn(2, HEADS, D)
    k, v = torch.randn(2, 16, 1, 4, KV_HEADS, D).unbind(0)
    with pytest.raises(ValueError, match="not laid out"):
        paged_attention(q, k, v, torch.zeros(2, 1, dtype=torch.long),
                        torch.ones(2, 1, dtype=torch.long), torch.arange(2)[:, None],
                        torch.empty_like(q), D ** -0.5)


def test_a_block_outside_the_pool_is_an_error_not_a_read():
    """A block id past the pool's end (an allocator bug) raises before the kernel reads memory
    that is not the pool's."""
    pool = _pool(torch.float32)
    layers = pool.layers(pool.target)
    seqs = [SeqSlice([0, 1], 5, 1), SeqSlice([pool.num_blocks + 3, 2], 5, 1)]   # reads, not writes
    attn = PagedAttention(layers, seqs, D ** -0.5, {}, fused=True)
    q = torch.randn(2, HEADS, D)
    k, v = torch.randn(2, KV_HEADS, D), torch.randn(2, KV_HEADS, D)
    with pytest.raises(IndexError, match="outside a pool"):
        attn(0, q, k, v)
    seqs = [SeqSlice([0, 1], 5, 1), SeqSlice([2, pool.num_blocks + 3], 5, 1)]   # a write
    for fused in (True, False):
        with pytest.raises(IndexError):
            PagedAttention(layers, seqs, D ** -0.5, {}, fused=fused)(0, q, k, v)


def _fill(kc: torch.Tensor, vc: torch.Tensor, tables: list, gen=None) -> None:
    """Random keys and values in the blocks of `tables` (a layer's view of a 256 MiB pool is
    strided: filling all of it took seconds a test)."""
    used = torch.tensor(sorted({b for t in tables for b in t}))
    for cache in (kc, vc):
        cache[used] = torch.randn(cache[used].shape, generator=gen).to(cache.dtype)


# (heads, kv heads, head size, target layers, draft (layers, kv heads, head size), block size,
# sequences, longest context): a toy shape; reference-py's target (5 heads of 64, 12 layers,
# 16-token blocks) and reference-py-deep's (16 layers beside a 1-layer draft: 48 tokens a block)
# at a batch of 32 as the benchmark runs them; and that deep draft's own layer (16 chunks of 80)
SHAPES = {"toy": (HEADS, KV_HEADS, D, 1, None, 4, 6, 60),
          "reference": (5, 5, 64, 12, (2, 4, 64), 16, 32, 300),
          "deep": (5, 5, 64, 16, (1, 3, 64), 16, 32, 300),
          "deep-draft": (3, 3, 64, 1, None, 1280, 12, 300)}


@pytest.mark.parametrize("shape,threads", [("toy", 1), ("toy", 2), ("reference", 2), ("deep", 2),
                                           ("deep-draft", 2)], indirect=["threads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rows_do_not_depend_on_the_batch(dtype, shape, threads):
    """Bit for bit: a query's output through the fused kernel is the same decoded alone, beside
    other sequences (whose longer contexts pad its keys), or as one of several query tokens
    of a verify. This is what makes greedy speculative output equal plain decoding in
    bfloat16; SDPA's rows move with the batch shape (checked here in float32, so that the test
    says something about the kernel and not about the inputs). At 2 threads too, as served
    and benchmarked (the suite runs 1)."""
    heads, kv_heads, d, n_layers, draft, bs, n_seqs, longest = SHAPES[shape]
    torch.manual_seed(0)
    pool = BlockPool(256 << 20, (n_layers, kv_heads, d), bs, dtype, "cpu", draft)
    layers = pool.layers(pool.target)
    kc, vc = layers[0]
    tpb = pool.target.tokens_per_block
    rng = random.Random(3)
    contexts = [rng.randrange(5, longest) for _ in range(n_seqs)]
    tables = [pool.allocate(-(-(c + 1) // tpb), "target") for c in contexts]
    _fill(kc, vc, tables)
    nq = 5
    q = torch.randn(len(contexts) * nq, heads, d, dtype=dtype)

    def attend(seqs, queries, fused):
        attn = PagedAttention(layers, seqs, d ** -0.5, {}, fused=fused)
        # the new tokens' keys and values are the ones already there: the pool stays as it is
        k, v = kc[attn.slots].clone(), vc[attn.slots].clone()
        return attn(0, queries, k, v).view(-1, heads, d)

    # the fused kernel, then SDPA in float32 only: rows move with the batch there (1e-7; in
    # bf16 the rounding hides most such moves at this size), found at the first row that moves
    for fused in (True, False) if dtype == torch.float32 else (True,):
        # A verify group: every sequence brings its last nq positions as queries.
        verify = attend([SeqSlice(t, c + 1 - nq, nq) for t, c in zip(tables, contexts)], q, fused)
        differ = 0
        for b, (t, c) in enumerate(zip(tables, contexts)):
            for i in range(nq if fused or not differ else 0):
                row = q[b * nq + i:b * nq + i + 1]
                alone = attend([SeqSlice(t, c + 1 - nq + i, 1)], row, fused)
                differ += not torch.equal(alone[0], verify[b * nq + i])
                if not fused:
                    continue
                # in a decode batch with every other sequence's query at the same index
                rows = torch.cat([q[j * nq + i:j * nq + i + 1] for j in range(len(tables))])
                batch = attend([SeqSlice(tj, cj + 1 - nq + i, 1) for tj, cj in zip(tables, contexts)],
                               rows, fused)
                assert torch.equal(alone[0], verify[b * nq + i]), (b, i)
                assert torch.equal(batch[b], verify[b * nq + i]), (b, i)
        if not fused:
            assert differ > 0


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d,n", [(5, 5, 64, 700), (8, 2, 64, 300)])
def test_prompt_pieces_do_not_depend_on_the_chunks(dtype, heads, kv_heads, d, n, threads):
    """Bit for bit: a prompt fed in one chunk, or cut at multiples of `prefill_align` into
    chunks attended beside other sequences' decode rows, gets the same attention output (the
    scheduler cuts only there: tests/engine/test_prefill_cuts.py). The same cuts with each
    chunk one SDPA call (the pieces as long as the chunk) do move rows: that is why a chunk
    runs in pieces."""
    align = 16
    pool = BlockPool(256 << 20, (1, kv_heads, d), align, dtype, "cpu", None)
    layers = pool.layers(pool.target)
    kc, vc = layers[0]
    table = pool.allocate(-(-n // align), "target")
    others = [pool.allocate(4, "target") for _ in range(3)]
    gen = torch.Generator().manual_seed(0)
    _fill(kc, vc, [table] + others, gen)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q, k, v = randn(n, heads, d), randn(n, kv_heads, d), randn(n, kv_heads, d)
    oq, ok, ov = randn(3, heads, d), randn(3, kv_heads, d), randn(3, kv_heads, d)

    def run(cuts, piece):
        outs = []
        for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
            mates = others[:i % 4]          # 0..3 decode rows beside the chunk
            seqs = [SeqSlice(t, 30 + j, 1) for j, t in enumerate(mates)]
            seqs.append(SeqSlice(table, a, b - a, piece))
            attn = PagedAttention(layers, seqs, d ** -0.5, {}, fused=True)
            m = len(mates)
            out = attn(0, torch.cat([oq[:m], q[a:b]]), torch.cat([ok[:m], k[a:b]]),
                       torch.cat([ov[:m], v[a:b]]))
            outs.append(out[m:])
        return torch.cat(outs)

    rng = random.Random(1)
    trials = [sorted(rng.sample(range(align, n, align), rng.randrange(1, 5))) for _ in range(12)]
    whole, moved = run([0, n], align), 0
    # The test's power: chunk-wide SDPA calls do move rows, so equality below is the pieces'
    # doing. On AVX2 CPUs they move at both shapes; on an AVX512/AMX Xeon torch's SDPA keeps
    # the 300-token prompt's rows at every cut, so the check is made where both move (and
    # ends at the first cut that moves them).
    sdpa_whole = run([0, n], 1 << 30) if n >= 700 else None
    for cuts in trials:
        assert torch.equal(run([0] + cuts + [n], align), whole), cuts
        if sdpa_whole is not None and not moved:
            moved += not torch.equal(run([0] + cuts + [n], 1 << 30), sdpa_whole)
    if n >= 700:
        assert moved > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_pieces_equal_per_sequence(dtype):
    """Prompt chunks attended in pieces of `prefill_align`: one from position 0 (its first piece
    causal over its own keys) and two past it, one starting mid-piece (later pieces causal from
    the bottom right: query i of a piece at `pos` sees keys 0..pos + i), beside a decode row.
    Red when a piece's queries see keys from the top left (0..i) or past their own position."""
    torch.manual_seed(0)
    pool = _pool(dtype)
    layers = pool.layers(pool.target)
    pool.pool.fill_(float("nan"))
    tpb = pool.target.tokens_per_block
    plan = [(0, 10, 4), (6, 13, 4), (8, 9, 2), (5, 1, 0)]       # (cached, query, prefill_align)
    seqs = [SeqSlice(pool.allocate(-(-(c + q) // tpb), "target"), c, q, a) for c, q, a in plan]
    kc, vc = layers[0]
    for s in seqs:
        for pos in range(s.num_cached):
            b, o = s.block_table[pos // tpb], pos % tpb
            _row(kc, b, o).normal_(), _row(vc, b, o).normal_()
    total = sum(q for _, q, _ in plan)
    q = torch.randn(total, HEADS, D, dtype=dtype)
    k, v = (torch.randn(total, KV_HEADS, D, dtype=dtype) for _ in range(2))
    out = PagedAttention(layers, seqs, D ** -0.5, {}, fused=False)(0, q, k, v)
    ref = reference(kc, vc, seqs, q, D ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.view(total, HEADS, D).float(), ref.float(), atol=tol, rtol=tol)


def test_the_cuda_form_of_a_pieces_mask_is_the_boolean_one():
    """On CUDA a piece's mask is torch's bottom-right causal bias, which the flash kernel takes
    (engine/attention.py: causal_from); it must equal the boolean mask used elsewhere, at every
    start and length. Red when the bias is aligned to the top left or offset. No CUDA needed:
    the bias holds only its two lengths."""
    for pos, stop in [(1, 2), (4, 8), (6, 19), (64, 128), (100, 101), (3, 300)]:
        bias = causal_from(pos, stop, "cuda")
        assert torch.equal(bias._materialize("cpu"), causal_from(pos, stop, "cpu")), (pos, stop)
