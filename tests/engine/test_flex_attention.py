"""FlexAttention over the pool in place (engine/flex_attention.py): decode and verify rows equal
a per-sequence reference, read only the pages their sequence holds, and the token-major pool is
the one sequence the kernel reads. Eager FlexAttention (the dense reference) checks the mask
rule on every slot; compiled on CPU (inductor's kernel, block-sparse as on a GPU) checks the
page lists: a page left off them is never read."""

import random

import pytest
import torch

from engine.attention import PagedAttention, SeqSlice, paged_backend, token_major
from engine.flex_attention import FlexGroup, FlexPages, bucket, pow2
from engine.kv_cache import BlockPool
from test_attention import reference

HEADS, KV_HEADS, D, LAYERS = 4, 2, 16, 2

# (cached, query) per sequence; "shared" sequences hold the first one's full blocks as a prefix
PLANS = {
    "decode": [(9, 1), (1, 1), (30, 1), (17, 1), (0, 1)],
    "page_edges": [(3, 1), (7, 1), (4, 1), (8, 2)],     # 0, 1 and 2 pages seen in part
    "verify": [(9, 3), (12, 6), (5, 5), (30, 2), (2, 17)],
    "mixed": [(0, 24), (8, 4), (13, 1), (4, 20), (2, 1), (3, 2)],
    "shared": [(21, 1), (22, 3), (23, 1)],
}


def _pool(layout, fill):
    target = (LAYERS, KV_HEADS, D)
    draft = {"target": None, "draft": (1, 1, D), "chunked": (3, 1, D)}[layout]
    pool = BlockPool(0, target, 4, torch.float32, "cpu", draft, num_blocks=64, token_major=True)
    pool.pool.fill_(fill)          # what blocks nobody holds contain (allocation zeroes a block)
    return pool, pool.draft if layout == "draft" else pool.target


def _seqs(pool, lay, plan, rng, scattered):
    tpb, seqs, prefix = lay.tokens_per_block, [], None
    for cached, nq in PLANS[plan]:
        n = -(-(cached + nq) // tpb)
        if plan == "shared" and prefix is not None:
            table = prefix + pool.allocate(n - len(prefix), "target")
        else:
            table = pool.allocate(n, "target")
            if scattered and rng.random() < 0.5:
                rng.shuffle(table)
            prefix = table[:cached // tpb] if plan == "shared" else None
        seqs.append(SeqSlice(table, cached, nq))
    return seqs


def _write_cached(seqs, layers, tpb):
    for s in seqs:
        for pos in range(s.num_cached):
            b, o = s.block_table[pos // tpb], pos % tpb
            for kc, vc in layers:
                for cache in (kc, vc):
                    cache[b, o // cache.shape[2], o % cache.shape[2]].normal_()


def _check(pool, lay, seqs, flex):
    """Attend every layer with `flex` and compare with the per-sequence reference; returns
    the PagedAttention (its groups)."""
    layers = pool.layers(lay)
    _write_cached(seqs, layers, lay.tokens_per_block)
    total = sum(s.num_query for s in seqs)
    attn = PagedAttention(layers, seqs, D ** -0.5, {}, flex=flex)
    for layer in range(lay.num_layers):
        q = torch.randn(total, HEADS, D)
        k, v = torch.randn(2, total, lay.num_kv_heads, D)
        out = attn(layer, q, k, v).view(total, HEADS, D)
        kc, vc = layers[layer]
        torch.testing.assert_close(out, reference(kc, vc, seqs, q, D ** -0.5), atol=1e-5,
                                   rtol=1e-5)
    return attn


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("layout", ["target", "draft", "chunked"])
@pytest.mark.parametrize("scattered", [False, True])
def test_flex_rows_equal_per_sequence_attention(plan, layout, scattered):
    """Eager: the mask rule is applied to every slot of the pool, so the other sequences'
    blocks and blocks nobody holds (random values here) must all be masked out by it."""
    torch.manual_seed(0)
    pool, lay = _pool(layout, 0.0)
    pool.pool.normal_()
    seqs = _seqs(pool, lay, plan, random.Random(len(plan)), scattered)
    flex = FlexPages(pool.layers(lay), 8, compiled=False)
    attn = _check(pool, lay, seqs, flex)
    kinds = [type(g).__name__ for g in attn.groups]
    assert kinds.count("FlexGroup") == 1        # decode and verify rows: one call a layer
    long = [s for s in seqs if s.num_query > 17]
    assert len(kinds) == 1 + len(long)           # prefill chunks keep SDPA


@pytest.mark.parametrize("layout", ["target", "chunked"])
def test_compiled_flex_reads_only_the_pages_listed(layout):
    """Compiled (block-sparse): with NaN in every block no sequence holds, the output is
    still the reference's, and every page a query needs is on the lists (a page left off
    them, or a count one short, is not read and the rows move)."""
    torch.manual_seed(1)
    pool, lay = _pool(layout, float("nan"))
    seqs = _seqs(pool, lay, "verify", random.Random(0), True)
    seqs += _seqs(pool, lay, "page_edges", random.Random(1), True)
    _check(pool, lay, seqs, FlexPages(pool.layers(lay), 16, compiled=True))


def test_block_mask_lists_full_and_partial_pages():
    """The lists themselves: pages every query row sees whole, then the last ones, in
    logical order, as chunk c of block b is page c * num_blocks + b."""
    pool, lay = _pool("chunked", 0.0)       # target: 3 chunks of 4 tokens a block (12)
    assert (lay.chunks, lay.tokens_per_block) == (3, 12)
    seqs = [SeqSlice([5, 9], 13, 3), SeqSlice([2], 3, 1)]
    flex = FlexPages(pool.layers(lay), 4, compiled=False)
    g = FlexGroup(flex, [s.block_table for s in seqs], [13, 3], [3, 1], [0, 3])
    m, nb = g.block_mask, pool.num_blocks
    assert (g.batch, g.qlen) == (2, 8)
    # sequence 0: keys 0..13 for its first row (pages 0-2 whole), 0..15 for its last (page 3)
    assert m.full_kv_num_blocks[:, 0, 0].tolist() == [3, 1]
    assert m.full_kv_indices[0, 0, 0, :3].tolist() == [5, nb + 5, 2 * nb + 5]
    assert m.kv_num_blocks[:, 0, 0].tolist() == [1, 0]
    assert m.kv_indices[0, 0, 0, 0].item() == 9
    assert flex.logical[0, [5, nb + 5, 2 * nb + 5, 9]].tolist() == [0, 1, 2, 3]
    assert flex.logical[1, 2].item() == 0 and int((flex.logical[1] >= 0).sum()) == 1
    assert flex.lens[0, :5].tolist() == [14, 15, 16, 16, 16] and flex.lens[1, 0].item() == 4


def test_pool_as_one_sequence_is_a_view_of_the_layers():
    pool, lay = _pool("chunked", 0.0)
    layers = pool.layers(lay)
    pool.pool.normal_()
    flex = FlexPages(layers, 4, compiled=False)
    kc = layers[1][0]
    seq = flex.sequence_of(kc)
    nb, chunks, per = kc.shape[:3]
    for block, chunk, row in [(0, 0, 0), (7, 2, 3), (63, 1, 2)]:
        page = chunk * nb + block
        assert torch.equal(seq[0, :, page * per + row], kc[block, chunk, row])
    assert seq.data_ptr() == kc.data_ptr()             # no copy


def test_flex_refuses_a_pool_laid_out_for_the_cpu_kernel():
    pool = BlockPool(0, (LAYERS, KV_HEADS, D), 4, torch.float32, "cpu", num_blocks=8)
    with pytest.raises(ValueError, match="token-major"):
        FlexPages(pool.layers(pool.target), 4, compiled=False)


def test_which_path_and_which_layout():
    assert paged_backend("cpu", "fused") == "fused" and not token_major("cpu", "fused")
    assert paged_backend("cpu", "sdpa") == "sdpa" and not token_major("cpu", "sdpa")
    assert paged_backend("cpu", "flex") == "flex" and token_major("cpu", "flex")
    assert paged_backend("cuda", "fused") == "flex" and token_major("cuda", "fused")
    assert paged_backend("cuda", "sdpa") == "sdpa" and token_major("cuda", "sdpa")


def test_buckets():
    assert [pow2(n) for n in (0, 1, 2, 3, 4, 5, 129)] == [1, 1, 2, 4, 4, 8, 256]
    assert [bucket(n, 128) for n in (1, 2, 3, 5, 64, 65, 128)] == [1, 2, 4, 8, 64, 128, 128]
    assert bucket(70, 96) == 96 and bucket(100, 96) == 100


def test_the_compiled_decode_kernel_gets_shapes_it_takes():
    """Torch's decode kernel packs a KV head's query heads into a tile: a group that is not a
    power of two is refused (the runner then gathers), and the query block holds the tile."""
    pool, lay = _pool("target", 0.0)
    layers = pool.layers(lay)
    with pytest.raises(ValueError, match="power of two"):
        FlexPages(layers, 4, compiled=True, group=6)
    assert FlexPages(layers, 4, compiled=False, group=6).q_block(32) == 256     # eager: any
    eight = FlexPages(layers, 4, compiled=False, group=8)
    assert [eight.q_block(n) for n in (1, 8, 32)] == [128, 128, 256]
    g = FlexGroup(eight, [[1, 2]], [5], [9], [0])
    assert g.qlen == 32 and g.block_mask.BLOCK_SIZE == (256, lay.tokens_per_block)


def test_a_new_runner_of_the_same_shapes_builds_no_new_kernel():
    """A swapped draft or another engine in the process gets new buffers and a new mask rule
    of the same shapes: the compiled kernels are reused, not built again (each build counts
    against dynamo's recompile limit, past which FlexAttention runs eager)."""
    from torch._dynamo.utils import counters

    def attend():
        pool, lay = _pool("target", 0.0)
        layers = pool.layers(lay)
        seqs = [SeqSlice([1, 2, 3], 9, 1), SeqSlice([4, 5], 5, 1)]
        q, k = torch.randn(2, HEADS, D), torch.randn(2, KV_HEADS, D)
        PagedAttention(layers, seqs, D ** -0.5, flex=FlexPages(layers, 8, compiled=True))(0, q, k, k)
        return counters["stats"]["unique_graphs"]

    built = attend()
    assert attend() == built
