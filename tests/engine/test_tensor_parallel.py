"""TP = 2 (two local processes, gloo) gives the greedy tokens of TP = 1."""

from conftest import hf_greedy
from engine.async_engine import AsyncEngine  # noqa: F401  (import check: no Ray needed)
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import RequestOptions, SamplingParams
from engine.tp_worker import LocalPeers


def test_tp2_matches_tp1_and_transformers(tiny_family, hf_target):
    budget = 4 << 20
    peers = LocalPeers(2, str(tiny_family["target"]), kv_budget_bytes=budget, port=29533,
                       draft=str(tiny_family["draft"]))
    try:
        engine = LLMEngine(EngineConfig(str(tiny_family["target"]), str(tiny_family["draft"]),
                                        tp_size=2, kv_budget_bytes=budget, profile=False,
                                        num_threads=1), peers=peers)
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
    finally:
        peers.close()
