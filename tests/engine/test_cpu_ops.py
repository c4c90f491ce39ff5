"""The forward's elementwise steps as C++ calls give what the torch ops they replace give: the
same bits in bfloat16 and float16 (each rounding where the eager op rounds), float32 within
its last bits (a fused multiply-add where torch rounds between), and each row on its own."""

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_ops
from engine.cpp_build import cpp_kernels
from models.llama import LlamaForward


def _close(a, b, dtype):
    if dtype == torch.float32:
        return torch.allclose(a, b, atol=1e-6, rtol=1e-6)
    return torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,size", [(1, 320), (37, 40), (3, 20)])
def test_add_norm_is_the_residual_add_and_transformers_norm(dtype, n, size):
    torch.manual_seed(0)
    hidden, delta = torch.randn(n, size).to(dtype), torch.randn(n, size).to(dtype)
    weight = torch.randn(size).to(dtype)
    summed = hidden + delta
    if dtype == torch.float32:
        ref = F.rms_norm(summed, (size,), weight, eps=1e-6)
    else:
        ref = weight * F.rms_norm(summed.float(), (size,), eps=1e-6).to(dtype)
    out = cpu_ops.add_norm(hidden, delta, weight, 1e-6)
    assert torch.equal(hidden, summed)                      # the residual stream, in place
    assert _close(out, ref, dtype)
    alone = cpu_ops.add_norm(summed[-1:].clone(), None, weight, 1e-6)
    assert torch.equal(alone[0], out[-1])                   # a row does not see its batch
    assert cpp_kernels.failed is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,inter", [(24, 40), (64, 864), (96, 72)])
def test_silu_mul_and_rope_are_the_eager_ops(dtype, d, inter):
    """Widths done two vectors at a time (64, 864), one at a time and in part (24, 40), and
    both (96: a rotated half of 48; 72)."""
    torch.manual_seed(1)
    n, heads, kv_heads = 19, 4, 2
    gate_up = torch.randn(n, 2 * inter).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert _close(cpu_ops.silu_mul(gate_up), F.silu(gate) * up, dtype)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d).to(dtype)
    freqs = torch.arange(n).float()[:, None] * (1e4 ** (-torch.arange(0, d, 2).float() / d))
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    sin[:, :d // 2].neg_()
    cos, sin = emb.cos().to(dtype), sin.to(dtype)
    out = cpu_ops.rope(qkv, heads + kv_heads, d, cos, sin)
    ref = LlamaForward._rope(qkv[:, :(heads + kv_heads) * d].view(n, -1, d), cos[:, None], sin[:, None])
    assert _close(out, ref, dtype)
    assert cpp_kernels.failed is None


def test_shapes_the_kernels_would_read_past_are_refused():
    """The C++ reads raw memory by the shapes it is given: a mismatch is a ValueError naming
    the op, not a read past a tensor."""
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="add_norm"):
        cpu_ops.add_norm(x, None, torch.randn(9), 1e-6)
    with pytest.raises(ValueError, match="silu_mul"):
        cpu_ops.silu_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match="rope"):
        cpu_ops.rope(x, 2, 8, torch.randn(3, 8), torch.randn(3, 8))    # 16 wide heads in 8
