"""The pool's plane-major layout: what makes attention stream, and what keeps blocks apart."""

import os

import pytest
import torch

from engine.kv_cache import BlockPool

# (target, draft) KV shapes (layers, kv heads, head dim): a draft whose layers divide the
# target's (reference-py: 12 and 2), one that does not, a deeper one, and none.
SHAPES = [((12, 5, 8), (2, 4, 8)), ((2, 2, 16), (3, 2, 24)), ((4, 1, 8), (6, 1, 8)),
          ((3, 2, 8), None)]


@pytest.mark.parametrize("target, draft", SHAPES)
def test_each_block_is_its_own_and_each_model_fills_it(target, draft):
    """Writing every K and V row of one block through a model's views touches that block's
    slice of the pool and nothing else, once per element; a draft fills the block exactly
    where the sizes allow (it does in every shape here)."""
    pool = BlockPool(1 << 20, target, 4, torch.float32, "cpu", draft)
    for layout in filter(None, (pool.target, pool.draft)):
        assert layout.tokens_per_block % layout.chunks == 0
        for b in (0, 1, pool.num_blocks - 1):
            pool.pool.zero_()
            for kc, vc in pool.layers(layout):
                assert kc.shape[1] * kc.shape[2] == layout.tokens_per_block
                kc[b] += 1
                vc[b] += 1
            assert pool.pool.max() == 1                           # no element written twice
            inside = pool.pool[:, b]
            assert inside.sum() == layout.elems_per_block == pool.block_elems
            assert pool.pool.sum() == inside.sum()                # nothing outside block b


def _one_run(t: torch.Tensor) -> bool:
    """The elements of `t` fill one gap-free run of memory, in whatever order its dims lie."""
    span = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size > 1 and stride != span:
            return False
        span *= size
    return True


def test_a_sequence_of_consecutive_blocks_is_one_run_per_layer():
    """One layer's keys of consecutive blocks are one contiguous run of memory (the hardware
    prefetcher streams it; the block-major layout before put every block's run 2 * layers
    runs apart, and a batch-32 decode step took 1.13x as long)."""
    pool = BlockPool(1 << 22, (12, 5, 8), 16, torch.bfloat16, "cpu", (2, 4, 8))
    assert pool.target.chunks == 1
    for kc, vc in pool.layers(pool.target):
        assert _one_run(kc[5:9]) and _one_run(vc[5:9])
        assert not _one_run(kc[5:9:2])
    # the draft's (layer, K/V) spans 6 planes: one run per plane
    kc, _ = pool.layers(pool.draft)[0]
    assert kc.shape[1] == 6 and _one_run(kc[5:9, 0])


@pytest.mark.parametrize("target, draft", SHAPES)
def test_a_heads_keys_of_a_block_are_one_run(target, draft):
    """Within a block, each KV head's keys (and values) of its tokens lie together, head after
    head, as vLLM's CPU cache lays them: the fused attention kernel reads a head's tokens of a
    block front to back instead of 1/heads of every token row
    (docs/decisions/0002-kv-pool-layout.md)."""
    pool = BlockPool(1 << 20, target, 4, torch.float32, "cpu", draft)
    for layout in filter(None, (pool.target, pool.draft)):
        for kc, vc in pool.layers(layout):
            for t in (kc, vc):
                for h in range(layout.num_kv_heads):
                    assert _one_run(t[3, 0, :, h])                # [tokens_per_chunk, head_dim]
            # values row by row (the next token, same head, one row on); keys d-major (the
            # next token is the next element, the next dim a chunk's tokens on), so that the
            # kernel scores a vector of keys at once (engine/cpu_attention.py)
            per_chunk = kc.shape[2]
            assert vc.stride(2) == layout.head_dim and vc.stride(4) == 1
            assert kc.stride(2) == 1 and kc.stride(4) == per_chunk


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_a_resident_pool_is_mapped_at_start_and_a_lazy_one_is_not():
    """`resident` writes the pool when it is made, so no served step faults a fresh block's pages
    in; without it the pool is address space only until blocks are written."""
    size = 256 << 20
    before = _resident_bytes()
    lazy = BlockPool(size, (12, 5, 8), 16, torch.float32, "cpu", (2, 4, 8))
    grown_lazy = _resident_bytes() - before
    del lazy
    before = _resident_bytes()
    pool = BlockPool(size, (12, 5, 8), 16, torch.float32, "cpu", (2, 4, 8), resident=True)
    grown = _resident_bytes() - before
    assert grown > 0.9 * pool.budget_bytes and grown_lazy < 0.1 * size
    assert not pool.pool.any()
