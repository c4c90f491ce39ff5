"""Tensor parallelism on CPU (ranks as local processes, gloo): TP = 2 gives the greedy tokens of
TP = 1, every rank zeroes the KV blocks rank 0 hands out, and a forward that fails on a rank
fails the whole group at once.

With a draft whose KV shape differs from the target's (as a 7B draft's differs from a 70B
target's), rank 0's pool uses more tokens per block than `block_size`; rank 1 must take that
layout from rank 0 (it is never told about the draft), or it reads and writes other slots.
"""

import time
from dataclasses import replace

import pytest

from conftest import hf_greedy
from engine.async_engine import AsyncEngine  # noqa: F401  (import check: no Ray needed)
from engine.config import EngineConfig
from engine.errors import TPGroupError
from engine.llm_engine import LLMEngine
from engine.memory import profile_forwards
from engine.sampling_params import RequestOptions, SamplingParams
from engine.tp_worker import LocalPeers, rank_options

PROMPTS = [[5, 7, 9, 11] * (i + 1) for i in range(4)]


def _config(tiny_family, draft=None, **kw):
    return EngineConfig(str(tiny_family["target"]), draft, tp_size=2, kv_budget_bytes=4 << 20,
                        profile=False, num_threads=1, adaptive_k=False, **kw)


def _run(engine, prompts=PROMPTS, max_tokens=12):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                      ignore_eos=True),
                           RequestOptions("speculative" if i % 2 else "baseline", k_max=3))
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
    return [outs[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("draft,attention,graphs", [
    ("same_shape", "fused", "auto"), ("odd_shape", "fused", "auto"),
    ("odd_shape", "flex", "auto"), ("odd_shape", "flex", "static")])
def test_tp2_matches_tp1_and_transformers(tiny_family, odd_draft, hf_target, draft, attention,
                                          graphs):
    """flex: every rank's pool is token-major and read in place (engine/flex_attention.py).
    static: every rank pads each decode and verify forward to rank 0's graph bucket
    (engine/cuda_graphs.py), its padding KV in rank 0's scratch block; red when a rank pads
    otherwise (its all-reduces would not match rank 0's) or writes padding into a real block."""
    draft_path = str(tiny_family["draft"] if draft == "same_shape" else odd_draft)
    config = _config(tiny_family, draft_path, attention=attention, graphs=graphs)
    peers = LocalPeers(config)
    try:
        engine = LLMEngine(config, peers=peers)
        assert engine.target.backend == attention and engine.pool.token_major == (attention == "flex")
        mode = "static" if graphs == "static" else None
        assert peers.call_rank(1, "attention_path") == {
            "backend": attention, "token_major": attention == "flex", "graphs": mode,
            "padded": 0 if mode else None}
        tpb = engine.pool.target.tokens_per_block
        assert (tpb == 16) == (draft == "same_shape"), tpb     # the odd draft changes the layout
        assert _run(engine) == [hf_greedy(hf_target, p, 12) for p in PROMPTS]
        assert engine.snapshot().num_draft_tokens > 0
        if mode:     # rank 1 ran rank 0's padded forwards, the draft's rounds padded too
            padded = peers.call_rank(1, "attention_path")["padded"]
            assert padded == engine.target.graphs.forwards > 10, padded
            assert engine.draft.graphs.forwards > 10
    finally:
        peers.close()


def test_rank_0_runs_the_memory_plans_forwards_alone(tiny_family, hf_target):
    """The memory plan's forwards (engine/memory.py: profile_forwards, what `measure_gpu`
    measures on a GPU) run before the other ranks take rank 0's plan, so rank 0 runs its shard
    alone, its all-reduces skipped; the group then still serves TP = 1's greedy tokens. Red when
    the profile's all-reduce waits for ranks that never join it (the collective times out and
    the group is broken), or when the all-reduce stays skipped (rank 0's partial sums)."""
    config = _config(tiny_family, str(tiny_family["draft"]))
    peers = LocalPeers(config)
    try:
        engine = LLMEngine(config, peers=peers)
        assert profile_forwards(engine) > 0                  # the scratch pool's bytes
        assert _run(engine) == [hf_greedy(hf_target, p, 12) for p in PROMPTS]
    finally:
        peers.close()


def test_ranks_are_built_from_rank_0s_config():
    """One builder of a rank's options: every field a rank needs comes from rank 0's config."""
    config = EngineConfig("/models/t", dtype="bfloat16", device="cpu", attention="sdpa",
                          num_threads=3, tp_size=4, fault_injection=True, row_plan_dir="/p",
                          max_num_seqs=48)
    assert rank_options(config) == {"target": "/models/t", "dtype": "bfloat16", "device": "cpu",
                                    "attention": "sdpa", "num_threads": 3, "max_num_seqs": 48,
                                    "fault_injection": True, "row_plan_dir": "/p"}


def test_other_ranks_zero_the_blocks_rank_0_hands_out(tiny_family, hf_target):
    """Rank 1's pool is filled with NaN, as stale memory may hold it. Gathered attention reads
    whole blocks (slots past a sequence's end under a zero weight), so a block rank 1 does not zero
    when rank 0 hands it out would turn its partial sums, and every token, into NaN.
    Breakage that turns it red: `TPWorker.run` skipping `zero_blocks`, or rank 0 not sending
    them (`ModelRunner(zeroed=None)`). Attention "sdpa" (the gather + SDPA path CUDA runs):
    the CPU kernel reads no slot past a sequence's end."""
    config = _config(tiny_family, fault_injection=True, attention="sdpa")
    peers = LocalPeers(config)
    try:
        engine = LLMEngine(config, peers=peers)
        peers.call_rank(1, "fill_pool", float("nan"))
        assert _run(engine) == [hf_greedy(hf_target, p, 12) for p in PROMPTS]
        peers.call_rank(1, "fill_pool", float("nan"))      # freed blocks, handed out again
        assert _run(engine, PROMPTS[:2]) == [hf_greedy(hf_target, p, 12) for p in PROMPTS[:2]]
    finally:
        peers.close()


def test_a_forward_that_fails_on_rank_1_fails_the_group(tiny_family):
    """Rank 1 raises between two layers' all-reduces while rank 0 waits in one. The step
    raises `TPGroupError` naming rank 1 (not a per-request error the engine would serve on
    after: the ranks' collectives would be out of step), well before the collective timeout,
    and the group refuses to run again."""
    config = _config(tiny_family, fault_injection=True)
    peers = LocalPeers(config)
    try:
        engine = LLMEngine(config, peers=peers)
        assert _run(engine, PROMPTS[:1], 4)          # the group serves
        peers.inject_fault(count=1, after=2)         # two forwards on, mid-request
        engine.add_request("x", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8,
                                                           ignore_eos=True))
        start = time.monotonic()
        with pytest.raises(TPGroupError, match="rank 1: InjectedFault"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 25         # the collective timeout is 30 s
        with pytest.raises(TPGroupError):
            engine.step()
    finally:
        peers.close()


def test_a_rank_in_another_dtype_is_refused_with_a_reason(tiny_family):
    """Rank 0 in bfloat16, rank 1 in float32: the all-reduce would mix tensor sizes and gloo
    aborts the whole process; the layout hand-off refuses it instead."""
    config = _config(tiny_family, dtype="bfloat16")
    peers = LocalPeers(replace(config, dtype="float32"))
    try:
        with pytest.raises(ValueError, match="rank runs float32 but rank 0 runs bfloat16"):
            LLMEngine(config, peers=peers)
    finally:
        peers.close()
