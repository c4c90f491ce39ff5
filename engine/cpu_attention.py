"""Paged attention on CPU in one call per layer: a C++ loop over torch's vector types.

Owns: the kernel that attends a group of sequences (decode or verify rows) to keys and values
read where they lie in the paged pool, the one that writes a forward's new keys and values into
it. Does not own: building the C++ kernels (`engine/cpp_build.py`), the per-forward metadata
(`engine/attention.py` builds the block table and the row lengths) or the pool's layout
(`engine/kv_cache.py`, whose key rows this kernel's loop follows).

Why: SDPA needs each sequence's keys contiguous, so the batched path first copies them out of
the pool into a padded buffer, and then reads them again; and SDPA's CPU rows move with their
batch-mates. inductor, given the same math over an indexed view of the pool, sums every key's
products horizontally and scores each query row of a verify in a pass of its own. So the kernel
is written here as the loop nest it should be, over `at::vec` (the vector types inductor's own
C++ uses, AVX2 / AVX512 / NEON chosen by torch for this CPU) and built by inductor's C++ cache
(so it needs what torch.compile needs on CPU: a C++ compiler; where building fails the engine
keeps gather + SDPA, says so once):
- keys are stored d-major within a block's run of one head (`[head_dim, tokens]`,
  `engine/kv_cache.py`), so the scores of a lane-width of keys are one vector, accumulated over
  the head dimension with no horizontal sum;
- up to RB query rows (a verify's tokens, a GQA group) share each key and value loaded, their
  accumulators held in registers;
- the next block's run is prefetched (blocks need not be adjacent).
The call itself costs a few microseconds (no dynamo, no guards). Timings against gather + SDPA,
the inductor kernel and vLLM's AMX kernel: docs/decisions/0004-cpu-kernels.md.

Numerics: scores, softmax and the weighted sum run in float32 (a bfloat16 pool is read and
converted in the kernel), so rows agree with SDPA's at the 1e-7 level. More: a row's output is a
function of its own query, keys and values only, bit for bit, whatever else is in the batch, how
far its keys are padded, how many query tokens its sequence brings or how many threads run
(tests): the work is split between threads by (sequence, head) only, and every sum has one
order that depends on nothing but the key's index (a key's score: four partial sums over the
head dimension, d mod 4, added (0+1)+(2+3); the softmax's sum: lane by key index mod the vector
width, then across lanes; the weighted sum: key after key). That is what makes greedy
speculative output equal plain decoding in bfloat16 (`engine/attention.py`).
"""

from __future__ import annotations

import logging

import torch

from engine.cpp_build import C_TYPES, cpp_kernels

log = logging.getLogger(__name__)

# What every kernel here and in `engine/cpu_ops.py` starts with: the element type T, float
# vectors of W lanes, and loads / stores that convert T to and from float (a count below W reads
# or writes only the first lanes).
PRELUDE = r'''
#include <torch/csrc/inductor/cpp_prefix.h>
using T = @T@;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();               // float lanes

template <typename TT> static inline Vec load_f(const TT* p, int64_t n = W) {
    if (n == W) {
        if constexpr (std::is_same_v<TT, float>) return Vec::loadu(p);
        else { Vec out; at::vec::load_to_float(p, out); return out; }
    }
    float tmp[W] = {};
    for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]);
    return Vec::loadu(tmp);
}

template <typename TT> static inline void store_t(TT* p, const Vec& v, int64_t n = W) {
    if constexpr (std::is_same_v<TT, float>) v.store(p, n);
    else at::vec::convert<TT>(v).store(p, n);
}

// v rounded to T and read back (what an eager op's output in T holds)
template <typename TT = T> static inline Vec round_t(const Vec& v) {
    if constexpr (std::is_same_v<TT, float>) return v;
    else { TT tmp[W]; store_t(tmp, v); return load_f(tmp); }
}

// 2W elements at once, as two float vectors held in registers: a reduced type's full vector
// converts both ways without the partial stores and reloads that `store_t` / `round_t` need for
// W of them (same rounding, half to two-thirds of the time of the rowwise kernels).
template <typename TT = T> static inline void load2(const TT* p, Vec& a, Vec& b) {
    if constexpr (std::is_same_v<TT, float>) { a = Vec::loadu(p); b = Vec::loadu(p + W); }
    else at::vec::load_to_float(p, a, b);
}

template <typename TT = T> static inline void store2(TT* p, const Vec& a, const Vec& b) {
    if constexpr (std::is_same_v<TT, float>) { a.store(p); b.store(p + W); }
    else at::vec::convert_from_float<TT>(a, b).store(p);
}

template <typename TT = T> static inline void round2(Vec& a, Vec& b) {
    if constexpr (!std::is_same_v<TT, float>)
        std::tie(a, b) = at::vec::convert_to_float<TT>(at::vec::convert_from_float<TT>(a, b));
}
'''

_SOURCE = PRELUDE + r'''
constexpr int64_t D = @D@;                       // head dim
constexpr int64_t DV = (D + W - 1) / W;          // vectors a value row
constexpr int64_t DT = D - (DV - 1) * W;         // lanes of its last vector
constexpr int64_t RB = std::max<int64_t>(1, std::min<int64_t>(8, 24 / DV));  // rows in registers

static inline void prefetch(const void* p, int64_t bytes) {
    for (int64_t x = 0; x < bytes; x += 64) __builtin_prefetch(static_cast<const char*>(p) + x);
}

// Scores of W consecutive keys (one per lane) against RC query rows: dim d of lane l's key at
// kp[d * ld + l]; four partial sums over d mod 4, added (0 + 1) + (2 + 3).
template <int RC, typename TT>
static inline void score_lanes(const TT* kp, int64_t ld, const float* qf, float* s, int64_t LP) {
    Vec a[RC][4];
    for (int r = 0; r < RC; ++r) for (int u = 0; u < 4; ++u) a[r][u] = Vec(0.f);
    for (int64_t d = 0; d < D; ++d) {
        const Vec kv = load_f(kp + d * ld);
        for (int r = 0; r < RC; ++r) a[r][d & 3] = at::vec::fmadd(Vec(qf[r * D + d]), kv, a[r][d & 3]);
    }
    for (int r = 0; r < RC; ++r) ((a[r][0] + a[r][1]) + (a[r][2] + a[r][3])).store(s + r * LP);
}

// One head's keys of a chunk are [D, tpc] (d-major); a chunk's last keys short of W lanes are
// copied, zero-padded, so that they go through the same code.
template <int RC>
static void scores(const T* kc, const int64_t* bt, int64_t h, int64_t nbl, int64_t chunks,
                   int64_t tpc, int64_t sb, int64_t sc, int64_t sh, const float* qf, float* s,
                   int64_t LP, float* tmp) {
    const int64_t tpb = chunks * tpc;
    for (int64_t jb = 0; jb < nbl; ++jb)
        for (int64_t c = 0; c < chunks; ++c) {
            const T* base = kc + bt[jb] * sb + c * sc + h * sh;
            if (jb + 1 < nbl) prefetch(kc + bt[jb + 1] * sb + c * sc + h * sh, tpc * D * sizeof(T));
            float* out = s + jb * tpb + c * tpc;
            int64_t t = 0;
            for (; t + W <= tpc; t += W) score_lanes<RC, T>(base + t, tpc, qf, out + t, LP);
            if (t < tpc) {
                for (int64_t d = 0; d < D; ++d)
                    for (int64_t l = 0; l < W; ++l)
                        tmp[d * W + l] = t + l < tpc ? static_cast<float>(base[d * tpc + t + l]) : 0.f;
                score_lanes<RC, float>(tmp, W, qf, out + t, LP);
            }
        }
}

// acc[r] = sum over keys j < last of e[r][j] * v[j], key after key; a value row is [D] (st apart).
template <int RC>
static void values(const T* vc, const int64_t* bt, int64_t h, int64_t last, int64_t chunks,
                   int64_t tpc, int64_t sb, int64_t sc, int64_t st, int64_t sh, const float* e,
                   int64_t LP, float* acc) {
    const int64_t tpb = chunks * tpc;
    Vec a[RC][DV];
    for (int r = 0; r < RC; ++r) for (int64_t i = 0; i < DV; ++i) a[r][i] = Vec(0.f);
    int64_t j = 0;
    for (int64_t jb = 0; j < last; ++jb)
        for (int64_t c = 0; c < chunks && j < last; ++c) {
            const T* vp = vc + bt[jb] * sb + c * sc + h * sh;
            if (j + tpb < last) prefetch(vc + bt[jb + 1] * sb + c * sc + h * sh, tpc * D * sizeof(T));
            const int64_t n = std::min(tpc, last - j);
            for (int64_t t = 0; t < n; ++t, ++j, vp += st) {
                Vec vv[DV];
                for (int64_t i = 0; i < DV; ++i) vv[i] = load_f(vp + i * W, i + 1 < DV ? W : DT);
                for (int r = 0; r < RC; ++r) {
                    const Vec w(e[r * LP + j]);
                    for (int64_t i = 0; i < DV; ++i) a[r][i] = at::vec::fmadd(w, vv[i], a[r][i]);
                }
            }
        }
    for (int r = 0; r < RC; ++r)
        for (int64_t i = 0; i < DV; ++i) a[r][i].store(acc + r * D + i * W, i + 1 < DV ? W : DT);
}

#define ROWS(F, ...) switch (rc) { case 1: F<1>(__VA_ARGS__); break; case 2: F<2>(__VA_ARGS__); break; \
    case 3: F<3>(__VA_ARGS__); break; case 4: F<4>(__VA_ARGS__); break; case 5: F<5>(__VA_ARGS__); break; \
    case 6: F<6>(__VA_ARGS__); break; case 7: F<7>(__VA_ARGS__); break; default: F<8>(__VA_ARGS__); }

// Query i of sequence n is token rows[n, i] of q and out ([tokens, kvh * g, D]: q_row, o_row
// apart, heads D apart); it sees keys 0 .. lens[n, i] - 1 of blocks[n]. Keys of head h, block
// k, chunk c, token t, dim d at kc[k*sb + c*sc + h*sh + d*tpc + t]; values at
// vc[k*vsb + c*vsc + h*vsh + t*vst + d].
extern "C" void kernel(const T* q, const T* kc, const T* vc, const int64_t* blocks,
                       const int64_t* lens, const int64_t* rows, T* out, const int64_t b,
                       const int64_t nq, const int64_t kvh, const int64_t g, const int64_t nb,
                       const int64_t chunks, const int64_t tpc, const int64_t sb,
                       const int64_t sc, const int64_t sh, const int64_t vsb, const int64_t vsc,
                       const int64_t vst, const int64_t vsh, const int64_t q_row,
                       const int64_t o_row, const float scale) {
    const int64_t tpb = chunks * tpc, L = nb * tpb, R = nq * g;
    const int64_t LP = (L + 2 * W - 1) / W * W;
    const float ninf = -std::numeric_limits<float>::infinity();
    #pragma omp parallel
    {
        std::vector<float> buf(R * LP + 2 * R * D + R + D * W);
        float* s = buf.data();
        float* qf = s + R * LP;
        float* acc = qf + R * D;
        float* sums = acc + R * D;
        float* tmp = sums + R;
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < b * kvh; ++item) {
            const int64_t n = item / kvh, h = item % kvh;
            const int64_t* ln = lens + n * nq;
            const int64_t* bt = blocks + n * nb;
            int64_t last = 0;
            for (int64_t i = 0; i < nq; ++i) last = std::max(last, std::min(ln[i], L));
            const int64_t nbl = (last + tpb - 1) / tpb, lw = (last + W - 1) / W * W;
            for (int64_t i = 0; i < nq; ++i)
                for (int64_t x = 0; x < g; ++x) {
                    const T* qp = q + rows[n * nq + i] * q_row + (h * g + x) * D;
                    for (int64_t d = 0; d < D; ++d) qf[(i * g + x) * D + d] = static_cast<float>(qp[d]);
                }
            for (int64_t r0 = 0; r0 < R; r0 += RB) {
                const int64_t rc = std::min<int64_t>(RB, R - r0);
                ROWS(scores, kc, bt, h, nbl, chunks, tpc, sb, sc, sh, qf + r0 * D, s + r0 * LP, LP, tmp)
            }
            const Vec scv(scale), ninfv(ninf);
            for (int64_t r = 0; r < R; ++r) {
                float* sr = s + r * LP;
                const int64_t len = std::min(ln[r / g], L);
                for (int64_t j = 0; j < lw; j += W) {          // scaled; -inf past the row's keys
                    const Vec x = Vec::loadu(sr + j) * scv;
                    (j + W <= len ? x : Vec::set(ninfv, x, std::max<int64_t>(0, len - j))).store(sr + j);
                }
                Vec mv(ninf);
                for (int64_t j = 0; j < lw; j += W) mv = at::vec::maximum(mv, Vec::loadu(sr + j));
                const float mx = at::vec::vec_reduce_all<float>(
                    [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, mv);
                Vec sv(0.f);
                const Vec mxv(mx);
                for (int64_t j = 0; j < lw; j += W) {
                    const Vec e = (Vec::loadu(sr + j) - mxv).exp();
                    e.store(sr + j);
                    sv = sv + e;
                }
                sums[r] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sv);
            }
            for (int64_t r0 = 0; r0 < R; r0 += RB) {
                const int64_t rc = std::min<int64_t>(RB, R - r0);
                ROWS(values, vc, bt, h, last, chunks, tpc, vsb, vsc, vst, vsh, s + r0 * LP, LP, acc + r0 * D)
            }
            for (int64_t i = 0; i < nq; ++i)
                for (int64_t x = 0; x < g; ++x) {
                    const int64_t r = i * g + x;
                    T* op = out + rows[n * nq + i] * o_row + (h * g + x) * D;
                    for (int64_t d = 0; d < D; ++d) op[d] = static_cast<T>(acc[r * D + d] / sums[r]);
                }
        }
    }
}
'''

# The new tokens' keys and values into the pool, one call a layer for both, where two
# `index_put_` calls a layer cost a noticeable share of a small batch's step
# (docs/decisions/0004-cpu-kernels.md). Token t's
# rows go to element offsets koff[t] / voff[t] of the layer's views; a key's dims are sd apart
# (d-major), a value's adjacent.
_WRITE_SOURCE = PRELUDE + r'''
extern "C" void kernel(const T* k, const T* v, T* kc, T* vc, const int64_t* koff,
                       const int64_t* voff, const int64_t n, const int64_t heads, const int64_t d,
                       const int64_t k_row, const int64_t v_row, const int64_t sh,
                       const int64_t sd, const int64_t vsh) {
    #pragma omp parallel for if (n > 64)
    for (int64_t t = 0; t < n; ++t) {
        const T* kr = k + t * k_row;
        const T* vr = v + t * v_row;
        T* kd = kc + koff[t];
        T* vd = vc + voff[t];
        for (int64_t h = 0; h < heads; ++h) {
            for (int64_t j = 0; j < d; ++j) kd[h * sh + j * sd] = kr[h * d + j];
            std::memcpy(vd + h * vsh, vr + h * d, d * sizeof(T));
        }
    }
}
'''

def _paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
           lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The kernel's math in torch ops (the reference the tests hold it to): q [b, nq, kv_heads,
    group, d]; k_cache, v_cache [num_blocks, chunks, tokens_per_chunk, kv_heads, d]; blocks
    [b, nb]; lens [b, nq] -> [b, nq, kv_heads, group, d], in float32 and rounded back."""
    b, nq, kv_heads, group, d = q.shape
    k = k_cache[blocks].flatten(1, 3).float()                     # [b, keys, kvh, d]
    v = v_cache[blocks].flatten(1, 3).float()
    s = torch.einsum("bqhgd,bkhd->bqhgk", q.float(), k) * scale
    visible = torch.arange(k.shape[1])[None, None, :] < lens[:, :, None]
    s = s.masked_fill(~visible[:, :, None, None, :], float("-inf"))
    return torch.einsum("bqhgk,bkhd->bqhgd", s.softmax(-1), v).to(q.dtype)


_ATTEND_ARGS = (["const T*"] * 3 + ["const int64_t*"] * 3 + ["T*"] + ["const int64_t"] * 16
                + ["const float"])
_WRITE_ARGS = ["const T*"] * 2 + ["T*"] * 2 + ["const int64_t*"] * 2 + ["const int64_t"] * 8


class _Kernel:
    @property
    def failed(self) -> str | None:
        return cpp_kernels.failed

    def __call__(self, q, k_cache, v_cache, blocks, lens, rows, out, scale: float) -> bool:
        """Attention of a group of sequences into `out`: q, out [tokens, heads, d] (each row's
        heads and dims contiguous); k_cache, v_cache one layer's views of the pool
        (`BlockPool.layers`: keys d-major within a block's head run, values row by row); blocks
        [b, nb] int64, every id below k_cache.shape[0] (the caller's check); lens, rows [b, nq]
        int64: query i of sequence n is token row rows[n, i] of q and out and sees keys
        0 .. lens[n, i] - 1 (>= 1) of its blocks (a row listed twice must see the same keys).
        False where the kernel cannot be built here (then the caller uses its gather + SDPA
        path; the reason is logged once and kept in `failed`)."""
        if cpp_kernels.failed is not None:
            return False
        b, nq = lens.shape
        _, heads, d = q.shape
        kv_heads = k_cache.shape[3]
        _, chunks, per_chunk, _, _ = k_cache.shape
        sb, sc, st, sh, sd = k_cache.stride()
        vsb, vsc, vst, vsh, vsd = v_cache.stride()
        if (st != 1 or sd != per_chunk or vsd != 1 or k_cache.dtype != q.dtype
                or v_cache.dtype != q.dtype or out.dtype != q.dtype or v_cache.shape != k_cache.shape
                or q.stride(2) != 1 or q.stride(1) != d or out.stride(2) != 1 or out.stride(1) != d
                or out.shape != q.shape or heads % kv_heads or q.dtype not in C_TYPES
                or any(t.dtype != torch.long or not t.is_contiguous() for t in (blocks, lens, rows))
                or blocks.shape[0] != b or rows.shape != lens.shape):
            raise ValueError("paged attention: inputs not laid out as the kernel reads them: "
                             f"q {tuple(q.shape)} {q.dtype}, keys {tuple(k_cache.stride())}, "
                             f"values {tuple(v_cache.stride())}")
        fn = cpp_kernels.get("attend", _SOURCE, _ATTEND_ARGS, q.dtype, d)
        if fn is None:
            return False
        fn(q, k_cache, v_cache, blocks, lens, rows, out, b, nq, kv_heads, heads // kv_heads,
           blocks.shape[1], chunks, per_chunk, sb, sc, sh, vsb, vsc, vst, vsh, q.stride(0),
           out.stride(0), float(scale))
        return True


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             koff: torch.Tensor, voff: torch.Tensor) -> bool:
    """Token t's key and value rows (k, v [n, kv_heads, d], each row's heads and dims
    contiguous) into the layer's views at element offsets koff[t], voff[t] (int64, from the
    views' strides: block, chunk and row of the token; every one inside the pool, the caller's
    check). False where the kernel cannot be built here (the caller writes with `index_put_`)."""
    n, heads, d = k.shape
    if (k.stride(2) != 1 or v.stride(2) != 1 or k.stride(1) != d or v.stride(1) != d
            or k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or k_cache.dtype not in C_TYPES
            or k_cache.stride(4) != k_cache.shape[2] or v_cache.stride(4) != 1):
        return False
    fn = cpp_kernels.get("write", _WRITE_SOURCE, _WRITE_ARGS, k_cache.dtype)
    if fn is None:
        return False
    fn(k, v, k_cache, v_cache, koff, voff, n, heads, d, k.stride(0), v.stride(0),
       k_cache.stride(3), k_cache.stride(4), v_cache.stride(3))
    return True


paged_attention = _Kernel()


def build(dtype: torch.dtype, head_dim: int) -> bool:
    """Build the attention and KV-write kernels for this dtype and head size now (a runner's
    start, not its first step), without touching any pool (a draft swapped in mid-serving
    shares the pool with live sequences); False where they cannot be built here."""
    if dtype not in C_TYPES:
        return False
    return (cpp_kernels.get("attend", _SOURCE, _ATTEND_ARGS, dtype, head_dim) is not None
            and cpp_kernels.get("write", _WRITE_SOURCE, _WRITE_ARGS, dtype) is not None)
