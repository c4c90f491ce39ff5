"""A checkpoint with 70B's proportions (8 query heads per KV head, MLP 3.5x hidden, an untied
head; random bf16, three safetensors shards) loads under TP = 4 over gloo with each rank
reading only its slices, and TP = 4's greedy tokens are TP = 1's.

Each rank's peak resident memory while loading grows by at most 1.15x the bytes of its shard
plus ALLOWANCE, a constant of the process and not of the model: one tensor in flight and
oneDNN's relayout of it, and the allocator's slack. Importing transformers' config classes
comes before the baseline (`TPWorker`), and the kernels built after loading (oneDNN's row plans)
are a phase of their own. A rank that read the whole checkpoint first (as transformers'
`from_pretrained` does) would grow by the whole model.
"""

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import RequestOptions, SamplingParams
from engine.tp_worker import LocalPeers

ALLOWANCE = 128 << 20
PROMPTS = [[5, 7, 9, 11, 13], [40, 41, 42]]


@pytest.fixture(scope="module")
def wide(tiny_family, tmp_path_factory):
    from tiny_models import make_sharded_llama

    folder = tmp_path_factory.mktemp("wide") / "target"
    return folder, make_sharded_llama(folder, tiny_family["target"])


def _greedy(engine) -> list[list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           RequestOptions("baseline"))
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
    return [outs[f"r{i}"] for i in range(len(PROMPTS))]


def test_tp4_ranks_hold_their_shards_and_match_tp1(wide):
    folder, checkpoint_bytes = wide
    config = EngineConfig(str(folder), tp_size=4, dtype="float32", kv_budget_bytes=4 << 20,
                          profile=False, num_threads=1)
    peers = LocalPeers(config)
    try:
        tp4 = _greedy(LLMEngine(config, peers=peers))
        served = 2 * checkpoint_bytes                     # bf16 on disk, float32 served
        for rank in (1, 2, 3):
            m = peers.call_rank(rank, "memory")
            growth = m["peak"] - m["resident_before"]
            # a quarter of the layers and the replicated embeddings, head and norms
            assert m["shard_bytes"] < 0.4 * served, m
            assert growth <= 1.15 * m["shard_bytes"] + ALLOWANCE, (rank, growth, m)
            print(f"rank {rank}: shard {m['shard_bytes'] >> 20} MiB, peak growth "
                  f"{growth >> 20} MiB, checkpoint as served {served >> 20} MiB")
    finally:
        peers.close()
    tp1 = _greedy(LLMEngine(EngineConfig(str(folder), dtype="float32", kv_budget_bytes=4 << 20,
                                         profile=False, num_threads=1)))
    assert tp4 == tp1
