"""The CUDA graphs' padded forward (engine/cuda_graphs.py), run without capture ("static") on
the CPU: what a replay computes. Padding tokens write only the scratch block, the real rows
equal the unpadded forward's, buffers left from a larger bucket change nothing, and greedy
speculative output equals plain decoding. tests/engine/test_gpu.py captures and replays."""

import random

import pytest
import torch

from conftest import run_all
from engine.attention import PagedAttention, SeqSlice
from engine.cuda_graphs import DecodeGraphs, graph_buckets, graph_mode, graph_plan
from engine.flex_attention import FlexPages
from engine.kv_cache import BlockPool
from engine.sampling_params import RequestOptions, SamplingParams
from test_flex_attention import HEADS, KV_HEADS, D, _write_cached

PLANS = [[(9, 1), (1, 1), (30, 1), (17, 1), (0, 1)],        # decode
         [(9, 3), (12, 6), (5, 5), (30, 2)],                 # verify
         [(13, 1), (2, 1), (3, 2), (8, 4)],                  # both
         [(3, 1)]]


def _pool():
    pool = BlockPool(0, (2, KV_HEADS, D), 4, torch.float32, "cpu", num_blocks=64,
                     token_major=True)
    pool.pool.normal_()      # finite everywhere: uninitialised NaN would compare unequal
    scratch = pool.reserve()
    return pool, scratch


def test_padded_attention_equals_unpadded_and_writes_only_the_scratch_block():
    torch.manual_seed(0)
    pool, scratch = _pool()
    layers = pool.layers(pool.target)
    pages = FlexPages(layers, 8, compiled=False, group=HEADS // KV_HEADS)
    for plan in PLANS + PLANS[::-1]:     # then each again after a larger or smaller one
        seqs = [SeqSlice(pool.allocate(-(-(c + q) // 4), "target"), c, q) for c, q in plan]
        _write_cached(seqs, layers, 4)
        n = sum(q for _, q in plan)
        q = torch.randn(n, HEADS, D)
        k, v = torch.randn(n, KV_HEADS, D), torch.randn(n, KV_HEADS, D)
        before = pool.pool.clone()
        want = PagedAttention(layers, seqs, D ** -0.5, flex=pages)(0, q, k, v)
        written = pool.pool.clone()
        size = n + 5
        pad_q = torch.cat([q, torch.randn(size - n, HEADS, D)])
        pad_k, pad_v = (torch.cat([t, torch.randn(size - n, KV_HEADS, D)]) for t in (k, v))
        pool.pool.copy_(before)
        got = PagedAttention(layers, seqs, D ** -0.5, flex=pages, pad=(size, scratch))(
            0, pad_q, pad_k, pad_v)
        assert torch.allclose(got[:n], want, atol=1e-6), plan
        changed = (pool.pool != written).any(dim=2).any(dim=0).nonzero().flatten().tolist()
        assert changed == [scratch], plan          # the padding's KV went to the scratch block
        for s in seqs:
            pool.free(s.block_table, "target")


def test_a_padded_forward_refuses_what_it_cannot_pad():
    pool, scratch = _pool()
    layers = pool.layers(pool.target)
    pages = FlexPages(layers, 8, compiled=False, group=2)
    prefill = [SeqSlice(pool.allocate(4, "target"), 0, 16, prefill_align=16)]
    with pytest.raises(ValueError, match="padded forward"):
        PagedAttention(layers, prefill, 0.25, flex=pages, pad=(20, scratch))
    decode = [SeqSlice(pool.allocate(1, "target"), 2, 1)]
    with pytest.raises(ValueError, match="padded forward"):
        PagedAttention(layers, decode, 0.25, flex=pages, pad=(1, scratch))   # no padding token
    graphs = DecodeGraphs(None, layers, pages, 0.25, scratch, "static")
    assert graphs.bucket(decode) == (1, 1)
    assert graphs.bucket([SeqSlice([0, 1, 2], 2, 5)] * 3) == (4, 8)
    assert graphs.bucket([SeqSlice([0, 1, 2, 3], 2, 9)]) is None         # longer: eager
    assert graphs.bucket(prefill) is None
    with pytest.raises(ValueError):
        DecodeGraphs(None, layers, pages, 0.25, scratch, "sometimes")


def test_the_scratch_block_is_reserved_for_good():
    pool = BlockPool(0, (2, KV_HEADS, D), 4, torch.float32, "cpu", num_blocks=8)
    for setting, attention in (("off", "flex"), ("auto", "flex"), ("static", "fused")):
        assert graph_plan(setting, "cpu", attention, None, pool) == (None, None)   # none reserved
    (mode, scratch), draft = graph_plan("static", "cpu", "flex", "gloo", pool)
    assert draft == (mode, scratch)             # the target's and the draft's: one scratch block
    assert mode == "static" and scratch == 7 and pool.num_blocks == pool.num_free == 7
    held = pool.allocate(7, "target")
    assert scratch not in held
    pool.free(held, "target")
    assert scratch not in pool.allocate(7, "target")
    with pytest.raises(ValueError, match="before any allocation"):
        pool.reserve()


def test_graphs_are_captured_where_a_graph_can_record_the_collectives():
    """auto: a GPU's FlexAttention path, at one rank or over NCCL. gloo's collectives cannot be
    captured, so a target under gloo (several ranks on one GPU) runs eagerly, while its draft,
    on rank 0 alone, still captures."""
    assert graph_mode("auto", "cuda", "flex") == "capture"
    assert graph_mode("auto", "cuda", "flex", "nccl") == "capture"
    assert graph_mode("auto", "cuda", "flex", "gloo") is None
    assert graph_mode("auto", "cpu", "flex") is None
    assert graph_mode("static", "cpu", "flex", "gloo") == "static"
    assert graph_mode("off", "cuda", "flex") is None
    pool = BlockPool(0, (2, KV_HEADS, D), 4, torch.float32, "cpu", num_blocks=8)
    assert graph_plan("auto", "cuda", "flex", "gloo", pool) == (None, ("capture", 7))


def test_greedy_speculative_through_padded_forwards_equals_plain_decoding(make_engine):
    """Batches growing and shrinking (arrivals at different steps, k 1..4), so buckets change
    and buffers keep what a larger bucket left. Red when a padding token's KV lands in a real
    block, a stale row or page reaches a real one, or a padded row is read as a real one."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [[5 + i, 7, 9 + 2 * i, 11] * (1 + i % 3) for i in range(7)]
    small = dict(kv_budget_bytes=1 << 20, attention="flex")
    plain = make_engine(draft=False, graphs="off", **small)
    rng = random.Random(0)
    arrivals = {}
    for i, p in enumerate(prompts):
        arrivals.setdefault(rng.randrange(5), []).append((f"r{i}", p, params))
    want, _ = run_all(plain, arrivals)
    engine = make_engine(adaptive_k=False, graphs="static", **small)
    spec = {step: [(r, p, s, RequestOptions(mode="speculative" if int(r[1:]) % 3 else "baseline",
                                            k_max=1 + int(r[1:]) % 4))
                   for r, p, s in reqs] for step, reqs in arrivals.items()}
    got, _ = run_all(engine, spec)
    assert got == want
    assert engine.target.graphs.forwards > 10 and engine.draft.graphs.forwards > 10
    assert len(engine.target.graphs.seen) >= 3          # several buckets


def test_warm_up_runs_every_bucket_twice_and_gives_its_blocks_back(make_engine):
    """Where graphs are captured, the engine runs each bucket twice at start (kernels built,
    then captured), largest first, on blocks it takes from the pool for the while; here in
    `static` mode, called directly. Red when a bucket is left out or run once, when its blocks
    stay taken, or when what it wrote reaches a request (greedy output then moves)."""
    small = dict(kv_budget_bytes=1 << 20, attention="flex", max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    arrivals = {0: [(f"r{i}", [5 + i, 7, 9, 11] * (1 + i), params,
                     RequestOptions(mode="speculative", k_max=3)) for i in range(3)]}
    want, _ = run_all(make_engine(draft=False, graphs="off", **small), dict(arrivals))
    engine = make_engine(adaptive_k=False, graphs="static", **small)
    pool = engine.pool
    free, used = pool.num_free, dict(pool.used_by)
    assert graph_buckets(8) == [(8, 8), (8, 1), (4, 8), (4, 1), (2, 8), (2, 1), (1, 8), (1, 1)]
    for runner, owner in ((engine.target, "target"), (engine.draft, "draft")):
        assert runner.warm_up(pool, owner) == 0        # at start only where graphs capture
        before = runner.graphs.forwards
        assert runner.warm_up(pool, owner, modes=("static",)) == 8
        assert runner.graphs.forwards - before == 16
        assert pool.num_free == free and pool.used_by == used
    got, _ = run_all(engine, dict(arrivals))
    assert got == want
