"""A Llama layer's elementwise steps on CPU as C++ loops: residual add + RMSNorm, RoPE, SiLU x up.

Owns: three row-wise kernels the model's forward calls between its projections
(`models/llama.py`), built like the attention kernel (`engine/cpu_attention.py`: `at::vec`, by
inductor's C++ cache; where building fails the forward keeps its torch ops). Does not own the
model's math (the forward decides what to call) or the projections (oneDNN).

Why: in eager torch each of these is several ops (a norm in bfloat16 is a cast, a reduction, a
multiply, a cast back and a scale; RoPE a concatenation, a product and a fused multiply-add),
each a dispatch and a pass over the rows. Here each is one call of a few microseconds, one pass
over its rows; inductor's compiled versions cost in their call path what they save at small
batches (figures: docs/decisions/0004-cpu-kernels.md).

Numerics follow the torch ops they replace, rounding where they round: the residual sum and
every product rounded to the model's dtype as eager bfloat16 ops round them; the norm in
float32 (transformers' LlamaRMSNorm: normalise in float32, cast, then scale by the weight).
Each row's result depends on that row alone (sums over a row in one fixed order), so rows stay
batch-invariant, which greedy speculative decoding's identity rests on (`engine/attention.py`).
"""

from __future__ import annotations

import torch

from engine.cpp_build import C_TYPES, cpp_kernels
from engine.cpu_attention import PRELUDE

# hidden [n, H] (row stride hs) += delta (row stride ds) if has_delta, rounded; then
# out [n, H] (contiguous) = weight * RMSNorm(hidden) as transformers computes it.
_ADD_NORM = PRELUDE + r'''
extern "C" void kernel(T* hidden, const T* delta, const T* weight, T* out, const int64_t n,
                       const int64_t H, const int64_t hs, const int64_t ds,
                       const int64_t has_delta, const float eps) {
    #pragma omp parallel for if (n >= 16)
    for (int64_t t = 0; t < n; ++t) {
        T* h = hidden + t * hs;
        const int64_t H2 = H / (2 * W) * (2 * W);      // the part done 2W at a time
        if (has_delta) {
            const T* dl = delta + t * ds;
            for (int64_t j = 0; j < H2; j += 2 * W) {
                Vec a, b, c, e;
                load2(h + j, a, b);
                load2(dl + j, c, e);
                store2(h + j, a + c, b + e);
            }
            for (int64_t j = H2; j < H; j += W) {
                const int64_t c = std::min(W, H - j);
                store_t(h + j, load_f(h + j, c) + load_f(dl + j, c), c);
            }
        }
        Vec acc(0.f);                                   // lane l: elements l, l + W, ... in order
        for (int64_t j = 0; j < H2; j += 2 * W) {
            Vec a, b;
            load2(h + j, a, b);
            acc = at::vec::fmadd(b, b, at::vec::fmadd(a, a, acc));
        }
        for (int64_t j = H2; j < H; j += W) {
            const Vec x = load_f(h + j, std::min(W, H - j));
            acc = at::vec::fmadd(x, x, acc);
        }
        const float ss = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
        const Vec inv(1.f / std::sqrt(ss / static_cast<float>(H) + eps));
        T* o = out + t * H;
        for (int64_t j = 0; j < H2; j += 2 * W) {
            Vec a, b, wa, wb;
            load2(h + j, a, b);
            load2(weight + j, wa, wb);
            a = a * inv;
            b = b * inv;
            round2(a, b);
            store2(o + j, a * wa, b * wb);
        }
        for (int64_t j = H2; j < H; j += W) {
            const int64_t c = std::min(W, H - j);
            store_t(o + j, round_t(load_f(h + j, c) * inv) * load_f(weight + j, c), c);
        }
    }
}
'''

# out [n, I] = silu(gate) * up, gate and up the halves of gate_up's rows (row stride gs).
_SILU_MUL = PRELUDE + r'''
extern "C" void kernel(const T* gate_up, T* out, const int64_t n, const int64_t I,
                       const int64_t gs) {
    #pragma omp parallel for if (n >= 16)
    for (int64_t t = 0; t < n; ++t) {
        const T* g = gate_up + t * gs;
        const T* u = g + I;
        T* o = out + t * I;
        const Vec one(1.f);
        const int64_t I2 = I / (2 * W) * (2 * W);
        for (int64_t j = 0; j < I2; j += 2 * W) {
            Vec x, y, ua, ub;
            load2(g + j, x, y);
            load2(u + j, ua, ub);
            Vec a = x / (one + x.neg().exp()), b = y / (one + y.neg().exp());
            round2(a, b);
            store2(o + j, a * ua, b * ub);
        }
        for (int64_t j = I2; j < I; j += W) {
            const int64_t c = std::min(W, I - j);
            const Vec x = load_f(g + j, c);
            const Vec s = round_t(x / (one + x.neg().exp()));
            store_t(o + j, s * load_f(u + j, c), c);
        }
    }
}
'''

# out [n, heads, D] (contiguous) = RoPE of the first `heads` heads of each qkv row (row stride
# rs, heads D apart): x * cos rounded, plus (x2, x1) * signed sin, rounded; cos, sin [n, D].
_ROPE = PRELUDE + r'''
extern "C" void kernel(const T* qkv, const T* cos, const T* sin, T* out, const int64_t n,
                       const int64_t heads, const int64_t D, const int64_t rs) {
    #pragma omp parallel for if (n >= 16)
    for (int64_t t = 0; t < n; ++t) {
        const T* c = cos + t * D;
        const T* s = sin + t * D;
        const int64_t half = D / 2, half2 = half / (2 * W) * (2 * W);
        for (int64_t h = 0; h < heads; ++h) {
            const T* x = qkv + t * rs + h * D;           // (x1, x2); rotated: (x2, x1)
            T* o = out + (t * heads + h) * D;
            for (int64_t j = 0; j < half2; j += 2 * W) {
                Vec x1a, x1b, x2a, x2b, ca, cb, sa, sb;
                load2(x + j, x1a, x1b);
                load2(x + half + j, x2a, x2b);
                load2(c + j, ca, cb);
                load2(s + j, sa, sb);
                Vec pa = x1a * ca, pb = x1b * cb;
                round2(pa, pb);
                store2(o + j, pa + x2a * sa, pb + x2b * sb);
                load2(c + half + j, ca, cb);
                load2(s + half + j, sa, sb);
                pa = x2a * ca;
                pb = x2b * cb;
                round2(pa, pb);
                store2(o + half + j, pa + x1a * sa, pb + x1b * sb);
            }
            for (int64_t j = half2; j < half; j += W) {
                const int64_t m = std::min(W, half - j);
                const Vec x1 = load_f(x + j, m), x2 = load_f(x + half + j, m);
                store_t(o + j, round_t(x1 * load_f(c + j, m)) + x2 * load_f(s + j, m), m);
                store_t(o + half + j, round_t(x2 * load_f(c + half + j, m)) + x1 * load_f(s + half + j, m), m);
            }
        }
    }
}
'''


def _ok(*tensors) -> bool:
    """Whether these tensors are ones the kernels take (CPU, one supported dtype, rows' last dim
    contiguous); else the caller's torch ops run."""
    return tensors[0].dtype in C_TYPES and all(
        t.device.type == "cpu" and t.dtype == tensors[0].dtype and t.stride(-1) == 1 for t in tensors)


def _check(ok: bool, what: str) -> None:
    """Shapes the C++ would read past: a clear error, never a read outside the tensors."""
    if not ok:
        raise ValueError(f"cpu_ops: {what}")


def add_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> torch.Tensor | None:
    """hidden [n, H] += delta (in place, rounded as `hidden + delta`), then weight * RMSNorm(hidden)
    as a new [n, H]; None where the kernel cannot run here (hidden untouched)."""
    parts = (hidden, weight) if delta is None else (hidden, delta, weight)
    if not _ok(*parts):
        return None
    _check(hidden.dim() == 2 and tuple(weight.shape) == (hidden.shape[1],)
           and (delta is None or delta.shape == hidden.shape), "add_norm: hidden [n, H], delta "
           f"like it, weight [H]; got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    fn = cpp_kernels.get("add_norm", _ADD_NORM,
                         ["T*", "const T*", "const T*", "T*"] + ["const int64_t"] * 5
                         + ["const float"], hidden.dtype)
    if fn is None:
        return None
    n, size = hidden.shape
    out = torch.empty(n, size, dtype=hidden.dtype)
    fn(hidden, hidden if delta is None else delta, weight, out, n, size, hidden.stride(0),
       0 if delta is None else delta.stride(0), int(delta is not None), float(eps))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """[n, 2I] -> silu(gate) * up [n, I] (gate the first half), or None where it cannot run."""
    if not _ok(gate_up):
        return None
    _check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0,
           f"silu_mul: gate_up [n, 2I]; got {tuple(gate_up.shape)}")
    fn = cpp_kernels.get("silu_mul", _SILU_MUL, ["const T*", "T*"] + ["const int64_t"] * 3,
                         gate_up.dtype)
    if fn is None:
        return None
    n, size = gate_up.shape
    out = torch.empty(n, size // 2, dtype=gate_up.dtype)
    fn(gate_up, out, n, size // 2, gate_up.stride(0))
    return out


def rope(qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor,
         sin: torch.Tensor) -> torch.Tensor | None:
    """RoPE of the first `heads` heads of qkv's rows -> [n, heads, head_dim]; cos, sin [n,
    head_dim] (sin's first half negated, `LlamaForward.rotary`). None where it cannot run."""
    if not _ok(qkv, cos, sin) or not cos.is_contiguous() or not sin.is_contiguous():
        return None
    n = qkv.shape[0]
    _check(qkv.dim() == 2 and qkv.shape[1] >= heads * head_dim and head_dim % 2 == 0
           and tuple(cos.shape) == tuple(sin.shape) == (n, head_dim),
           f"rope: qkv [n, >= heads * head_dim], cos and sin [n, head_dim]; got "
           f"{tuple(qkv.shape)}, {tuple(cos.shape)}, {heads} heads of {head_dim}")
    fn = cpp_kernels.get("rope", _ROPE, ["const T*"] * 3 + ["T*"] + ["const int64_t"] * 4,
                         qkv.dtype)
    if fn is None:
        return None
    out = torch.empty(n, heads, head_dim, dtype=qkv.dtype)
    fn(qkv, cos, sin, out, n, heads, head_dim, qkv.stride(0))
    return out


def build(dtype: torch.dtype) -> bool:
    """Build the three kernels for this dtype now (a model runner's start, not its first step);
    False where they cannot be built here."""
    x = torch.zeros(1, 4, dtype=dtype)
    return all(r is not None for r in (add_norm(x, x.clone(), x[0], 1e-6), silu_mul(x),
                                       rope(x, 1, 4, x, x)))
