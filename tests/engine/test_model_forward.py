"""Our Llama forward over the paged cache gives transformers' logits (float32, 1e-4)."""

import pytest
import torch

from engine.attention import PagedAttention, SeqSlice
from engine.kv_cache import BlockPool
from models.llama import LlamaForward
from models.loader import load_model


def _setup(path):
    m = load_model(path)
    fw = LlamaForward(m.model)
    s = fw.shape
    pool = BlockPool(4 << 20, (s.num_layers, s.num_kv_heads, s.head_dim), 4, torch.float32, "cpu")
    return m, fw, pool, pool.layers(pool.target), s.head_dim ** -0.5


@pytest.mark.parametrize("fused", [False, True])
def test_prefill_then_ragged_decode_matches_transformers(tiny_family, fused):
    """Gather + SDPA and eager ops, and the C++ kernels (attention for decode/verify groups, the
    KV write, the elementwise steps) give the same logits."""
    m, fw, pool, view, scale = _setup(tiny_family["target"])
    fw.cpu_ops = fused
    torch.manual_seed(0)
    ids = torch.randint(1, 300, (3, 13))
    with torch.no_grad():
        ref = m.model(ids).logits                                   # [3, 13, vocab]
    tables = [pool.allocate(4, "target") for _ in range(3)]
    tables[1] = tables[1][::-1]                                     # one table out of order
    lens = [9, 5, 12]                                               # prefill lengths differ
    attn = PagedAttention(view, [SeqSlice(t, 0, n) for t, n in zip(tables, lens)], scale,
                          fused=fused)
    flat = torch.cat([ids[i, :n] for i, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    logits = fw.logits(fw.forward(flat, pos, attn))
    start = 0
    for i, n in enumerate(lens):
        assert torch.allclose(logits[start:start + n], ref[i, :n], atol=1e-4)
        start += n
    # Then a verify-like step: 4, 1 and 1 query tokens.
    more = [4, 1, 1]
    attn = PagedAttention(view, [SeqSlice(t, n, q) for t, n, q in zip(tables, lens, more)], scale,
                          fused=fused)
    assert any(g.fused for g in attn.groups) == fused
    flat = torch.cat([ids[i, n:n + q] for i, (n, q) in enumerate(zip(lens, more))])
    pos = torch.cat([torch.arange(n, n + q) for n, q in zip(lens, more)])
    logits = fw.logits(fw.forward(flat, pos, attn))
    start = 0
    for i, (n, q) in enumerate(zip(lens, more)):
        assert torch.allclose(logits[start:start + q], ref[i, n:n + q], atol=1e-4)
        start += q


def test_draft_view_shares_the_pool(tiny_family):
    d = load_model(tiny_family["draft"])
    t = load_model(tiny_family["target"])
    ft, fd = LlamaForward(t.model), LlamaForward(d.model)
    st, sd = ft.shape, fd.shape
    pool = BlockPool(1 << 20, (st.num_layers, st.num_kv_heads, st.head_dim), 16, torch.float32, "cpu",
                     (sd.num_layers, sd.num_kv_heads, sd.head_dim))
    assert pool.layers(pool.draft)[0][0].data_ptr() == pool.pool.data_ptr()
    assert pool.draft.elems_per_block <= pool.block_elems
    blocks = pool.allocate(3, "draft")
    assert pool.bytes_used("draft") == 3 * pool.block_bytes
    pool.free(blocks, "draft")
    assert pool.bytes_used("draft") == 0 and pool.num_free == pool.num_blocks


def test_the_fused_kernel_never_compiles_while_serving(tiny_family):
    """The runner builds its C++ kernels at start (attention, the KV write, the elementwise
    steps); afterwards no batch shape (sequences, blocks, query tokens, a context under one
    block) may build again: a build takes seconds mid-step (a TP rank that compiled missed its
    liveness ping and took its replica down)."""
    from engine.cpu_attention import cpp_kernels
    from engine.model_runner import ModelRunner
    m, fw, pool, layers, scale = _setup(tiny_family["target"])
    cpp_kernels._fns.clear()                 # as in a fresh process (the disk cache stays)
    runner = ModelRunner(fw, layers, attention="fused")
    assert runner.fused
    built = cpp_kernels.builds
    tpb = pool.target.tokens_per_block
    rng = torch.Generator().manual_seed(0)
    for batch, context, query in [(2, 1, 1), (2, 2, 2), (3, 9, 1), (4, 3 * tpb + 1, 4), (2, 2, 3),
                                  (5, 2 * tpb, 7), (2, tpb - 1, 1), (6, 1, 2), (1, 1, 1),
                                  (1, 3 * tpb, 1), (1, 5, 3), (1, 2 * tpb + 1, 6)]:
        tables = [pool.allocate(-(-(context + query) // tpb), "target") for _ in range(batch)]
        seqs = [SeqSlice(t, context, query) for t in tables]
        ids = torch.randint(1, 300, (batch * query,), generator=rng).tolist()
        pos = [context + j for _ in range(batch) for j in range(query)]
        attn_groups = PagedAttention(layers, seqs, scale, fused=True).groups
        assert all(g.fused for g in attn_groups), (batch, context, query)
        runner.run(seqs, ids, pos, [0])
        for t in tables:
            pool.free(t, "target")
    assert cpp_kernels.builds == built


def test_projection_row_counts_are_bucketed_with_little_padding():
    """oneDNN builds a kernel per row count (~0.75 ms): above EXACT_ROWS the forward pads to one
    of 8 counts an octave, never more than 12.5%, so a model meets ~72 counts up to 2048."""
    from models.llama import EXACT_ROWS, onednn_rows
    counts = [onednn_rows(m) for m in range(1, 2049)]
    assert counts[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))
    assert all(c >= m and c - m <= m / 8 for m, c in enumerate(counts, 1))
    assert counts == sorted(counts) and len(set(counts)) <= 72
    assert all(onednn_rows(c) == c for c in counts)          # a bucket is its own bucket


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_projections_give_each_row_what_it_gets_alone(tiny_family, dtype):
    """The zero rows a projection is padded with change no bit of the real rows (each row of a
    oneDNN projection is computed alone), and are not returned."""
    from models.llama import onednn_rows
    m = load_model(tiny_family["target"], dtype=dtype)
    fw = LlamaForward(m.model)
    if fw.kernel != "onednn":
        pytest.skip("oneDNN projections only")
    layer = fw.layers[0]
    x = torch.randn(300, layer.gate_up.shape[1], generator=torch.Generator().manual_seed(0)).to(dtype)
    for rows in (17, 37, 300):
        out = fw._linear(x[:rows], layer.gate_up)
        assert out.shape[0] == rows                          # ran at the bucket, cut back
        assert out.untyped_storage().nbytes() == onednn_rows(rows) * out[0].nbytes
        for i in (0, rows // 2, rows - 1):
            assert torch.equal(out[i], fw._linear(x[i:i + 1], layer.gate_up)[0]), (rows, i)


def test_warm_builds_every_row_count_the_forward_can_meet(tiny_family):
    m = load_model(tiny_family["target"])
    fw = LlamaForward(m.model)
    if fw.kernel != "onednn":
        pytest.skip("oneDNN projections only")
    seen, linear = set(), fw._linear
    fw._linear = lambda x, w, b=None: seen.add((x.shape[0], tuple(w.shape))) or linear(x, w, b)
    fw.warm(300, 40)
    from models.llama import onednn_rows
    layer = fw.layers[0]
    for rows in range(1, 301):
        for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            assert (onednn_rows(rows), tuple(w.shape)) in seen, rows
        assert ((onednn_rows(rows), tuple(fw.lm_head.shape)) in seen) == (rows <= 40), rows
