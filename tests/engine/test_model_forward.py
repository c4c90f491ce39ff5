"""Our Llama forward over the paged cache gives transformers' logits (float32, 1e-4)."""

import pytest
import torch

from engine.attention import PagedAttention, SeqSlice
from engine.kv_cache import BlockPool
from models.llama import LlamaForward
from models.loader import load_model


def _setup(path):
    m = load_model(path)
    fw = LlamaForward.from_module(m.model)
    s = fw.shape
    pool = BlockPool(4 << 20, (s.num_layers, s.num_kv_heads, s.head_dim), 4, torch.float32, "cpu")
    return m, fw, pool, pool.layers(pool.target), s.head_dim ** -0.5


@pytest.mark.parametrize("fused", [False, True])
def test_prefill_then_ragged_decode_matches_transformers(tiny_family, fused):
    """Gather + SDPA and eager ops, and the C++ kernels (attention for decode/verify groups, the
    KV write, the elementwise steps) give the same logits."""
    m, fw, pool, view, scale = _setup(tiny_family["target"])
    from engine import cpu_ops

    fw.ops = cpu_ops if fused else None
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
    ft, fd = LlamaForward.from_module(t.model), LlamaForward.from_module(d.model)
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
    from engine.cpp_build import cpp_kernels
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
    from models.cpu_linear import EXACT_ROWS, onednn_rows
    counts = [onednn_rows(m) for m in range(1, 2049)]
    assert counts[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))
    assert all(c >= m and c - m <= m / 8 for m, c in enumerate(counts, 1))
    assert counts == sorted(counts) and len(set(counts)) <= 72
    assert all(onednn_rows(c) == c for c in counts)          # a bucket is its own bucket


@pytest.fixture(scope="module")
def wide_mlp(tmp_path_factory):
    """A tiny Llama whose MLP is 864 wide (reference-py's): oneDNN's bfloat16 kernels split a
    sum that wide differently once a call has more than ~32 rows."""
    from tiny_models import make_llama, make_tokenizer
    folder = tmp_path_factory.mktemp("wide-mlp")
    make_llama(folder, make_tokenizer(folder), layers=1, hidden=320, heads=5, kv_heads=5, mlp=864)
    return folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projections_give_each_row_what_it_gets_alone(wide_mlp, dtype):
    """Padded to a bucket (zero rows, not returned) or run in pieces, every row of a projection
    has the bits it gets alone: what greedy speculative decoding equal to plain decoding rests
    on (a verify forward has n x (k + 1) rows, a decode n). Calling oneDNN at every row count,
    the 864-wide down projection in bfloat16 gave other bits at 36-288 rows."""
    fw = LlamaForward.from_module(load_model(wide_mlp, dtype=dtype).model)
    if fw.kernel != "onednn":
        pytest.skip("oneDNN projections only")
    layer = fw.layers[0]
    gen = torch.Generator().manual_seed(0)
    for weight, bias in ((layer.gate_up, None), (layer.down, layer.down_bias)):
        x = torch.randn(2100, weight.shape[1], generator=gen).to(dtype)
        alone = torch.cat([fw._linear(x[i:i + 1], weight, bias) for i in range(300)])
        for rows in (17, 37, 96, 200, 300):
            assert torch.equal(fw._linear(x[:rows], weight, bias), alone[:rows]), rows
        out = fw._linear(x, weight, bias)                  # past the rows a plan was made for
        assert out.shape[0] == 2100 and torch.equal(out[:300], alone)
        plan = fw.row_plans[(tuple(weight.shape), bias is None)]
        assert all(m in plan.good for m in plan.calls(2100))
        assert sum(plan.calls(37)) >= 37 and sum(plan.calls(37)) - 37 < max(plan.calls(37))


def test_a_row_plan_keeps_its_calls_to_row_counts_that_are_built_and_exact(wide_mlp):
    """No projection at up to 2048 rows (the LM head 512) calls oneDNN at a row count its plan
    did not try and find exact (each new one also builds a kernel mid-step: ~0.75 ms)."""
    from models.cpu_linear import onednn_rows
    fw = LlamaForward.from_module(load_model(wide_mlp, dtype=torch.bfloat16).model)
    if fw.kernel != "onednn":
        pytest.skip("oneDNN projections only")
    calls, onednn = [], fw.linear._onednn
    fw.linear._onednn = lambda x, w, b, m: calls.append((m, tuple(w.shape))) or onednn(x, w, b, m)
    layer = fw.layers[0]
    for weight, bias, top in ((layer.qkv, layer.qkv_bias, 2048), (layer.down, layer.down_bias, 2048),
                              (fw.lm_head, None, 512)):
        plan = fw.row_plans[(tuple(weight.shape), bias is None)]
        assert len(plan.plans) == len({onednn_rows(m) for m in range(1, top + 1)})
        for rows in range(1, top + 1, 7):
            calls.clear()
            fw._linear(torch.zeros(rows, weight.shape[1], dtype=torch.bfloat16), weight, bias)
            assert all(m in plan.good for m, _ in calls), (rows, calls)


def test_a_row_plan_read_back_from_its_file_is_the_plan_built(wide_mlp, tmp_path):
    """The first build keeps each projection's plan in a file; a second forward reads it (and
    builds no plan) and runs every row count with the same calls and the same bits. A plan of
    another thread count, or an unreadable file, is built again."""
    from models import cpu_linear
    from models.cpu_linear import RowPlan
    from models.loader import load_served

    def forward():
        fw = load_served(wide_mlp, torch.bfloat16, tokenizer=False).forward    # kernels not built
        fw.build_kernels(tmp_path)
        return fw

    built = forward()
    if built.kernel != "onednn":
        pytest.skip("oneDNN projections only")
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == len(built.row_plans) > 0
    calls = []
    real_init = RowPlan.__init__
    RowPlan.__init__ = lambda self, *a: calls.append(a) or real_init(self, *a)
    try:
        read = forward()
        assert calls == []                              # every plan came from its file
        for key, plan in built.row_plans.items():
            assert read.row_plans[key].good == plan.good and read.row_plans[key].plans == plan.plans
        layer, x = read.layers[0], torch.randn(300, built.layers[0].down.shape[1]).bfloat16()
        for rows in (1, 17, 37, 300):
            assert torch.equal(read._linear(x[:rows], layer.down, layer.down_bias),
                               built._linear(x[:rows], built.layers[0].down,
                                             built.layers[0].down_bias))
        files[0].write_text("{not json")
        threads = torch.get_num_threads()
        forward()
        assert len(calls) == 1                          # the unreadable one only
        torch.set_num_threads(threads + 1)
        try:
            forward()
        finally:
            torch.set_num_threads(threads)
        assert len(calls) == 1 + len(built.row_plans)   # another key: all built again
    finally:
        RowPlan.__init__ = real_init
    assert cpu_linear.plan_key((4, 8), False, torch.float32, 16) != \
        cpu_linear.plan_key((4, 8), True, torch.float32, 16)
