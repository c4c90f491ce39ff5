"""TP = 2 (two local processes, gloo) gives the greedy tokens of TP = 1.

With a draft whose KV shape differs from the target's (as a 7B draft's differs from a 70B
target's), rank 0's pool uses more tokens per block than `block_size`; rank 1 must take that
layout from rank 0 (it is never told about the draft), or it reads and writes other slots.
"""


import pytest

from conftest import hf_greedy
from engine.async_engine import AsyncEngine  # noqa: F401  (import check: no Ray needed)
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import RequestOptions, SamplingParams
from engine.tp_worker import LocalPeers
from models.rendezvous import free_port


@pytest.mark.parametrize("draft", ["same_shape", "odd_shape"])
def test_tp2_matches_tp1_and_transformers(tiny_family, odd_draft, hf_target, draft):
    budget = 4 << 20
    draft_path = str(tiny_family["draft"] if draft == "same_shape" else odd_draft)
    peers = LocalPeers(2, str(tiny_family["target"]), port=free_port())
    try:
        engine = LLMEngine(EngineConfig(str(tiny_family["target"]), draft_path,
                                        tp_size=2, kv_budget_bytes=budget, profile=False,
                                        num_threads=1, adaptive_k=False), peers=peers)
        tpb = engine.pool.target.tokens_per_block
        assert (tpb == 16) == (draft == "same_shape"), tpb     # the odd draft changes the layout
        prompts = [[5, 7, 9, 11] * (i + 1) for i in range(4)]
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                               RequestOptions("speculative" if i % 2 else "baseline", k_max=3))
        outs = {}
        while engine.has_unfinished():
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.token_ids)
        for i, p in enumerate(prompts):
            assert outs[f"r{i}"] == hf_greedy(hf_target, p, 12)
        assert engine.snapshot().num_draft_tokens > 0
    finally:
        peers.close()


def test_a_rank_in_another_dtype_is_refused_with_a_reason(tiny_family):
    """Rank 0 in bfloat16, rank 1 in float32: the all-reduce would mix tensor sizes and gloo
    aborts the whole process (what `LocalPeers`' old float32 default did beside an engine whose
    dtype "auto" is bfloat16 on an AVX512-BF16 CPU); the layout hand-off refuses it instead."""
    peers = LocalPeers(2, str(tiny_family["target"]), dtype="float32", port=free_port())
    try:
        with pytest.raises(ValueError, match="rank runs float32 but rank 0 runs bfloat16"):
            LLMEngine(EngineConfig(str(tiny_family["target"]), None, tp_size=2, dtype="bfloat16",
                                   kv_budget_bytes=4 << 20, profile=False, num_threads=1),
                      peers=peers)
    finally:
        peers.close()
