"""The engine on CUDA (skipped without a CUDA device): paged attention (gather + SDPA, and
compiled FlexAttention in place) equals the per-sequence reference, and greedy speculative
output equals plain decoding, in float32 and bfloat16."""

import random

import pytest
import torch

from conftest import run_all
from engine.attention import PagedAttention, SeqSlice
from engine.flex_attention import FlexGroup, FlexPages
from engine.kv_cache import BlockPool
from engine.sampling_params import RequestOptions, SamplingParams
from test_attention import PLANS, reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _equals_reference(attn, layers, seqs, dtype):
    """Layer 0 of `attn` on random queries equals the per-sequence reference on the CPU."""
    total = sum(s.num_query for s in seqs)
    q = torch.randn(total, 4, 64, dtype=dtype, device="cuda")
    k = torch.randn(total, 2, 64, dtype=dtype, device="cuda")
    out = attn(0, q, k, k.clone()).view(total, 4, 64)
    ref = reference(layers[0][0].cpu(), layers[0][1].cpu(), seqs, q.cpu(), 64 ** -0.5)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(out.cpu().float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_cuda_attention_equals_per_sequence(dtype, plan):
    torch.manual_seed(0)
    pool = BlockPool(4 << 20, (2, 2, 64), 16, dtype, "cuda")
    pool.pool.normal_()
    layers = pool.layers(pool.target)
    seqs = [SeqSlice(pool.allocate(-(-(c + q) // 16), "target"), c, q) for c, q in PLANS[plan]]
    _equals_reference(PagedAttention(layers, seqs, 64 ** -0.5), layers, seqs, dtype)


def test_cuda_prompt_pieces_past_position_0_run_flash_attention():
    """A prompt chunk past position 0 attends in pieces causal from the bottom right: with
    grouped-query heads in bfloat16, CUDA's flash kernel takes them (SDPA's other backends are
    refused here, so a piece sent to the math backend raises), and the rows equal the
    reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    pool = BlockPool(4 << 20, (2, 2, 64), 16, torch.bfloat16, "cuda")
    pool.pool.normal_()
    layers = pool.layers(pool.target)
    seqs = [SeqSlice(pool.allocate(4, "target"), 0, 40, prefill_align=16),
            SeqSlice(pool.allocate(4, "target"), 20, 37, prefill_align=16)]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        _equals_reference(PagedAttention(layers, seqs, 64 ** -0.5), layers, seqs, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_flex_attention_equals_per_sequence(dtype):
    """Compiled FlexAttention (the default on CUDA) over a token-major pool whose blocks nobody
    holds are NaN: decode and verify rows equal the reference, prefill chunks keep SDPA."""
    torch.manual_seed(0)
    pool = BlockPool(4 << 20, (2, 2, 64), 16, dtype, "cuda", token_major=True)
    pool.pool.fill_(float("nan"))
    layers = pool.layers(pool.target)
    plan = PLANS["mixed"] + PLANS["verify"] + PLANS["decode"]
    seqs = [SeqSlice(pool.allocate(-(-(c + q) // 16), "target"), c, q) for c, q in plan]
    for s in seqs:
        for pos in range(s.num_cached):
            for cache in layers[0]:
                cache[s.block_table[pos // 16], 0, pos % 16].normal_()
    attn = PagedAttention(layers, seqs, 64 ** -0.5, flex=FlexPages(layers, 32, compiled=True))
    assert sum(isinstance(g, FlexGroup) for g in attn.groups) == 1
    _equals_reference(attn, layers, seqs, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_speculative_equals_plain(make_engine, dtype):
    prompts = [[5 + i, 7, 9 + 2 * i, 11] * (1 + i % 4) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = []
    for p in prompts:
        e = make_engine(draft=False, dtype=dtype, device="cuda")
        e.add_request("p", p, params)
        plain.append(run_all(e)[0]["p"])
    e = make_engine(dtype=dtype, device="cuda", adaptive_k=False)
    rng = random.Random(0)
    arrivals = {}
    for i, p in enumerate(prompts):
        opts = RequestOptions(mode="speculative" if i % 2 else "baseline", k_max=1 + i % 4)
        arrivals.setdefault(rng.randrange(4), []).append((f"r{i}", p, params, opts))
    outs, _ = run_all(e, arrivals)
    assert [outs[f"r{i}"] for i in range(len(prompts))] == plain


def test_cuda_decode_step_synchronises_once(make_engine):
    """A speculative decode step (greedy and sampled rows, k = 3) waits for the GPU once: torch's
    sync debug mode flags each synchronisation (docs/decisions/0038-one-host-read-per-step.md;
    tests/engine/test_host_syncs.py counts the same calls on the CPU)."""
    import warnings

    e = make_engine(device="cuda", adaptive_k=False)
    for i, t in enumerate([0.0, 1.0]):
        e.add_request(f"r{i}", [5 + i, 7, 9, 11] * 4, SamplingParams(temperature=t, max_tokens=64,
                                                                     ignore_eos=True),
                      RequestOptions(mode="speculative", k_max=3))
    for _ in range(6):                   # the prefill, every kernel built, every graph captured
        e.step()
    counts = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(6):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                e.step()
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert max(counts) <= 1, counts


def test_cuda_graphs_replay_what_eager_forwards_compute(make_engine):
    """Greedy speculative (k 1..4) and baseline requests arriving at different steps: with the
    forwards captured and replayed from CUDA graphs (the default on a GPU) the tokens equal
    those without graphs (engine/cuda_graphs.py)."""
    prompts = [[5 + i, 7, 9 + 2 * i, 11] * (1 + i % 3) for i in range(7)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    rng = random.Random(0)
    arrivals = {}
    for i, p in enumerate(prompts):
        opts = RequestOptions(mode="speculative" if i % 3 else "baseline", k_max=1 + i % 4)
        arrivals.setdefault(rng.randrange(5), []).append((f"r{i}", p, params, opts))
    outs = {}
    for graphs in ("off", "auto"):
        e = make_engine(device="cuda", adaptive_k=False, graphs=graphs)
        outs[graphs], _ = run_all(e, dict(arrivals))
    assert outs["auto"] == outs["off"]
    g = e.target.graphs
    assert g is not None and g.mode == "capture" and g.graphs and e.draft.graphs.graphs


def test_cuda_graphs_warmed_up_at_start_replay_what_eager_forwards_compute(make_engine):
    """graph_warmup: every bucket (here batches 1 and 2, 1 or 8 query tokens) is captured
    before the first request, for the target and the draft, and greedy tokens equal those
    without graphs (engine/model_runner.py: warm_up)."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    arrivals = {0: [(f"r{i}", [5 + i, 7, 9, 11] * (2 + i), params,
                     RequestOptions(mode="speculative", k_max=3)) for i in range(2)]}
    outs = {}
    for graphs in ("off", "auto"):
        e = make_engine(device="cuda", adaptive_k=False, graphs=graphs, graph_warmup=True,
                        max_num_seqs=2)
        if graphs == "auto":
            assert len(e.target.graphs.graphs) == len(e.draft.graphs.graphs) == 4
        outs[graphs], _ = run_all(e, dict(arrivals))
    assert outs["auto"] == outs["off"]
