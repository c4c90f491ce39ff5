"""engine.hardware: hand-counted bytes and the roofline."""

import pytest

from engine.hardware import GPUS, MODELS, RooflineStepCost


# Hand counts from the published configs: per layer q,k,v,o + gate,up,down + 2 norms; embeddings,
# LM head (unless tied), final norm.
def _hand_params(layers, h, heads, kv_heads, inter, vocab, tied=False, head_dim=None):
    hd = head_dim or h // heads
    per_layer = h * heads * hd * 2 + 2 * h * kv_heads * hd + 3 * h * inter + 2 * h
    return layers * per_layer + vocab * h * (1 if tied else 2) + h


@pytest.mark.parametrize("name,params,kv_bytes", [
    ("Llama-2-70B", _hand_params(80, 8192, 64, 8, 28672, 32000), 2 * 80 * 8 * 128 * 2),
    ("Llama-2-7B", _hand_params(32, 4096, 32, 32, 11008, 32000), 2 * 32 * 32 * 128 * 2),
    ("Llama-3-8B", _hand_params(32, 4096, 32, 8, 14336, 128256), 2 * 32 * 8 * 128 * 2),
    ("Llama-3.2-1B", _hand_params(16, 2048, 32, 8, 8192, 128256, tied=True, head_dim=64),
     2 * 16 * 8 * 64 * 2),
])
def test_model_bytes_match_hand_counts(name, params, kv_bytes):
    m = MODELS[name]
    assert m.param_count() == params
    assert m.weight_bytes(2) == 2 * params
    assert m.kv_bytes_per_token(2) == kv_bytes


def test_published_sizes():
    assert MODELS["Llama-2-70B"].kv_bytes_per_token() == 327_680  # the hand count
    assert MODELS["Llama-2-70B"].param_count() == 68_976_648_192
    assert MODELS["Llama-2-7B"].param_count() == 6_738_415_616
    assert MODELS["Llama-3-8B"].param_count() == 8_030_261_248
    assert MODELS["Llama-3.2-1B"].param_count() == 1_235_814_400


A100, L70, L7 = GPUS["A100-80GB"], MODELS["Llama-2-70B"], MODELS["Llama-2-7B"]


def test_roofline_memory_bound_at_batch_one():
    cost = RooflineStepCost(A100, L70, L7, tp=4, draft_tp=4, overhead_s=0.0, draft_overhead_s=0.0)
    weights_s = L70.matmul_params() * 2 / 4 / A100.mem_bw
    allreduce_s = 2 * 80 * A100.allreduce_latency_s
    assert cost.target_s(1, 1) == pytest.approx(weights_s + allreduce_s, rel=0.01)
    # compute-bound for a long prefill: FLOPs over the matmul rate, plus ring all-reduces of
    # [8192, 8192] bf16 activations, 2 per layer, moving 2 (tp - 1) / tp of the bytes each
    flops_s = 8192 * 2 * L70.matmul_params() / 4 / A100.flops
    ring_s = 2 * 80 * (A100.allreduce_latency_s + 8192 * 8192 * 2 * 1.5 / A100.link_Bps)
    assert cost.target_s(1, 8192) == pytest.approx(flops_s + ring_s, rel=0.02)
    assert cost.target_s(64, 64) < 1.2 * cost.target_s(1, 1)  # decode batch stays memory-bound


def test_draft_placement_changes_the_cost_ratio():
    sharded = RooflineStepCost(A100, L70, L7, tp=4, draft_tp=4)
    whole = RooflineStepCost(A100, L70, L7, tp=4, draft_tp=1)
    c_sharded = sharded.draft_s(1, 1) / sharded.target_s(1, 1)
    c_whole = whole.draft_s(1, 1) / whole.target_s(1, 1)
    assert 0.08 < c_sharded < 0.2 and 0.25 < c_whole < 0.45
    assert c_whole / c_sharded > 2  # 4x the weight bytes per GPU, less after fixed costs
    with pytest.raises(ValueError):
        RooflineStepCost(A100, L70).draft_s(1, 1)
