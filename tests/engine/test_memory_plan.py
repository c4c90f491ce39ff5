"""GPU memory planning (engine/memory.py) as arithmetic on given numbers: the production
shapes on A100-80GB, a budget too small for one sequence refused with its numbers, and
`specserve models plan` on the production config."""

import argparse

import pytest

from engine.hardware import GPUS, MODELS, GiB
from engine.memory import (InsufficientMemoryError, MemoryPlan, activation_bytes,
                           graph_pool_bytes, plan_from_specs)

A100 = GPUS["A100-80GB"]


def test_the_budget_is_what_utilization_leaves_after_weights_activations_and_the_rest():
    plan = MemoryPlan(device_bytes=80 * GiB, utilization=0.9, weight_bytes=40 * GiB,
                      activation_bytes=2 * GiB, other_bytes=GiB, graph_pool_bytes=GiB // 2,
                      kv_bytes_per_token=1 << 20, max_model_len=4096)
    assert plan.usable_bytes == 72 * GiB
    assert plan.kv_budget_bytes == 72 * GiB - 40 * GiB - 2 * GiB - GiB - GiB // 2
    assert plan.min_kv_bytes == 4096 << 20
    assert plan.max_tokens == (28 * GiB + GiB // 2) // (1 << 20)
    plan.check()


def test_a_budget_that_cannot_hold_one_sequence_is_refused_with_its_numbers():
    plan = MemoryPlan(80 * GiB, 0.9, 68 * GiB, 2 * GiB, GiB, 0, 1 << 20, 4096)
    assert plan.kv_budget_bytes == GiB < plan.min_kv_bytes
    with pytest.raises(InsufficientMemoryError, match=r"(?s)max_model_len.*weights.*68\.00 GiB"
                                                      r".*KV budget.*1\.00 GiB"):
        plan.check()


def test_activations_grow_with_tokens_and_logit_rows():
    one = activation_bytes(4096, 4096, 1024, 14336, 128256, 2, tokens=512, logit_rows=64)
    # per token: 3 x 4096 + 4096 + 2 x 1024 + 4096 + 3 x 14336 bytes x 2; logits 3 x 64 x vocab x 4
    per_token = (3 * 4096 + 4096 + 2 * 1024 + 4096 + 3 * 14336) * 2
    assert one == 512 * per_token + 3 * 64 * 128256 * 4


def test_production_target_rank_0_on_a100_80gb():
    """Llama-2-70B over four ranks with the Llama-2-7B draft on rank 0, bf16, 0.90: rank 0
    holds a quarter of 70B's layers, its embeddings and head whole, and all of the draft."""
    plan = plan_from_specs(A100.memory_bytes, 0.90, MODELS["Llama-2-70B"], MODELS["Llama-2-7B"],
                           tp=4, dtype_bytes=2, max_num_batched_tokens=512, max_num_seqs=64,
                           max_model_len=4096)
    # hand count: a 70B layer 2 x 8192^2 + 2 x 8192 x 1024 + 3 x 8192 x 28672 + 2 x 8192
    layer_70b = 2 * 8192**2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    rank0_70b = 80 * layer_70b // 4 + 2 * 32000 * 8192 + 8192
    layer_7b = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    draft_7b = 32 * layer_7b + 2 * 32000 * 4096 + 4096
    assert plan.weight_bytes == 2 * (rank0_70b + draft_7b)
    # KV a token: this rank's 2 of 8 KV heads of 70B, and all 32 of the 7B draft's
    assert plan.kv_bytes_per_token == 2 * 80 * 2 * 128 * 2 + 2 * 32 * 32 * 128 * 2
    plan.check()
    assert 20 * GiB < plan.kv_budget_bytes < 30 * GiB
    assert plan.max_tokens // 4096 >= 8                     # eight full-length sequences or more


def test_production_small_tier_and_70b_on_one_gpu():
    small = plan_from_specs(A100.memory_bytes, 0.90, MODELS["Llama-3-8B"], None, tp=1,
                            dtype_bytes=2, max_num_batched_tokens=512, max_num_seqs=128,
                            max_model_len=8192)
    small.check()
    assert small.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    alone = plan_from_specs(A100.memory_bytes, 0.90, MODELS["Llama-2-70B"], None, tp=1,
                            dtype_bytes=2, max_num_batched_tokens=512, max_num_seqs=64,
                            max_model_len=4096)
    with pytest.raises(InsufficientMemoryError):
        alone.check()


def test_the_cuda_graph_pool_holds_the_largest_capture_and_every_bucket_output():
    """engine/cuda_graphs.py captures (batch 1..128 in powers of two) x (1 or 8 query tokens),
    batch x query + 1 tokens each: the pool holds the largest one's activations once (target
    or draft, whichever is more) and every bucket's hidden states."""
    target, draft = (4096, 4096, 1024, 14336), (2048, 2048, 512, 8192)
    kept = sum(b * q + 1 for b in (1, 2, 4, 8, 16, 32, 64, 128) for q in (1, 8))
    assert kept == 2311
    largest = activation_bytes(*target, 0, 2, tokens=128 * 8 + 1, logit_rows=0)
    assert graph_pool_bytes([target, draft], 2, 128) == largest + (4096 + 2048) * kept * 2
    # max_num_seqs 100: the largest bucket is 100 sequences (engine/flex_attention.py: bucket)
    kept_100 = sum(b * q + 1 for b in (1, 2, 4, 8, 16, 32, 64, 100) for q in (1, 8))
    assert graph_pool_bytes([target], 2, 100) == (
        activation_bytes(*target, 0, 2, tokens=100 * 8 + 1, logit_rows=0) + 4096 * kept_100 * 2)
    assert graph_pool_bytes([], 2, 128) == 0
    # the planner: the target's graphs at one rank and over NCCL, the draft's on rank 0
    # (engine/cuda_graphs.py: graph_mode); the target's widths are a rank's
    one = plan_from_specs(A100.memory_bytes, 0.90, MODELS["Llama-3-8B"], None, tp=1,
                          dtype_bytes=2, max_num_batched_tokens=512, max_num_seqs=128,
                          max_model_len=8192)
    four = plan_from_specs(A100.memory_bytes, 0.90, MODELS["Llama-2-70B"], MODELS["Llama-2-7B"],
                           tp=4, dtype_bytes=2, max_num_batched_tokens=512, max_num_seqs=64,
                           max_model_len=4096)
    assert one.graph_pool_bytes == graph_pool_bytes([(4096, 4096, 1024, 14336)], 2, 128)
    rank = (8192, 8192 // 4, 1024 // 4, 28672 // 4)
    assert four.graph_pool_bytes == graph_pool_bytes([rank, (4096, 4096, 4096, 11008)], 2, 64)


def _plan_cli(config, capsys):
    from cluster.cli import models_plan

    code = models_plan.run(argparse.Namespace(config=str(config), gpu="A100-80GB"))
    return code, capsys.readouterr().out


def test_models_plan_prints_the_production_config(capsys):
    from pathlib import Path

    config = Path(__file__).resolve().parents[2] / "cluster/configs/llama2-70b-4xa100.yaml"
    code, out = _plan_cli(config, capsys)
    assert code == 0, out
    assert out.count("fits") == 2 and "DOES NOT FIT" not in out
    assert "target: /models/Llama-2-70b-hf + draft /models/Llama-2-7b-hf, tp_size 4" in out


def test_models_plan_exits_1_when_a_tier_does_not_fit(tmp_path, capsys):
    from pathlib import Path

    source = Path(__file__).resolve().parents[2] / "cluster/configs/llama2-70b-4xa100.yaml"
    text = source.read_text().replace("tp_size: 4", "tp_size: 1").replace(
        "num_replicas: 1            # one per 4-GPU worker node", "num_replicas: 1")
    (tmp_path / "one-gpu.yaml").write_text(text)
    code, out = _plan_cli(tmp_path / "one-gpu.yaml", capsys)
    assert code == 1 and "DOES NOT FIT" in out
