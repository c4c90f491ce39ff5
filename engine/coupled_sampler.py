"""Seeded sampling that does not depend on k, batch-mates or load: the Gumbel-max coupling.

Why: rejection sampling (`engine/rejection_sampler.py`) draws a different number of random
numbers per position depending on k (one uniform per draft, a recovered or bonus draw per step),
and k depends on batch-mates, acceptance history and measured step times. So a seeded request's
text would change with the tier and the load. A seeded request instead uses noise that is a pure
function of (seed, absolute position, token id), and one rule in every mode:

- **plain decoding (k = 0)**: the token at position t is `argmax_v(log p_t(v) + g_t(v))`, where
  p_t is the target's distribution after temperature, top-k and top-p (`engine/sampler.py`, the
  same function in both modes) and `g_t(v)` is standard Gumbel noise derived from
  (seed, t, v). By the Gumbel-max trick the token is distributed exactly as p_t.
- **speculative (k > 0)**: the draft proposes `argmax_v(log q_t(v) + g_t(v))` with the SAME
  noise g_t, and the target's token at each verified position is `argmax_v(log p_t(v) + g_t(v))`.
  A draft token is **accepted** when it equals the target's token; at the first mismatch the
  target's token is emitted (the **recovered** token), and after k accepts the target's token at
  position k+1 (the **bonus** token). Each step still emits accepted + 1 tokens.

Every emitted token is the target's own coupled sample at its position, so the output equals
plain seeded decoding token for token (standard == premium == auto for a seed) and its
distribution is exactly p. It is greedy verification on Gumbel-perturbed log-probabilities, so
`spec_decode` reuses the greedy path of `rejection_sample` with these tokens as the target's
choice. The price: a draft token is accepted with P(argmax(log q + g) = argmax(log p + g)),
which is at most sum(min(p, q)), rejection sampling's rate (the measured difference:
docs/decisions/0012-seeded-coupled-sampling.md).
Unseeded requests keep rejection sampling.

The noise is counter-based: an integer hash (Wellons' lowbias32) of (seed, position, token id) in int64
tensor arithmetic that never overflows, so it is the same on every device and batch layout, and
needs no generator state. 32 hash bits give u in (0, 1) (the Gumbel tail is cut at 2^-33, an
error far below anything measurable), then g = -log(-log u) in float64.
Owns the noise and the coupled choice. Does not own temperature/top-k/top-p (`engine/sampler.py`)
nor the accept loop (`engine/rejection_sampler.py`).
"""

from __future__ import annotations

import torch

from engine.host_sync import upload

SAMPLER_VERSION = "gumbel-coupled-v1"   # bump when the noise or the rule changes (fingerprint)

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) and c < 2^31: the int64 product never overflows."""
    return (x * c) & _M32


def _hash32(h: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 (2022 constants, both < 2^31): a bijection of [0, 2^32), full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x21F0AAAD)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x735A2D97)
    return h ^ (h >> 15)


def row_keys(seeds: list[int], positions: list[int], device) -> torch.Tensor:
    """[rows] 32-bit keys, one per (seed, absolute position)."""
    s = [x & ((1 << 64) - 1) for x in seeds]
    lo = upload([x & _M32 for x in s], torch.long, device)
    hi = upload([x >> 32 for x in s], torch.long, device)
    pos = upload([p & _M32 for p in positions], torch.long, device)
    h = _hash32(lo ^ 0x3C6EF372)
    h = _hash32(h ^ _hash32((hi + 0x1B873593) & _M32))
    return _hash32(h ^ _hash32(_mul32(pos, 0x7F4A7C15) ^ 0x3C6EF372))


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows] keys -> [rows, vocab_size] standard Gumbel noise (float64), a pure function.

    Element (r, v) is `_hash32(keys[r] ^ mix(v))`, written in place (the same values as
    `_hash32`, at a third of the time: fresh 2.6 MB temporaries per op cost more than the math).
    """
    tokens = _mul32(torch.arange(vocab_size, dtype=torch.long, device=keys.device), 0x27D4EB2F)
    h = torch.bitwise_xor(keys[:, None], tokens[None, :])               # [rows, vocab_size]
    tmp = torch.empty_like(h)
    for shift, c in ((16, 0x21F0AAAD), (15, 0x735A2D97)):
        torch.bitwise_right_shift(h, shift, out=tmp)
        h.bitwise_xor_(tmp).mul_(c).bitwise_and_(_M32)
    torch.bitwise_right_shift(h, 15, out=tmp)
    h.bitwise_xor_(tmp)
    u = h.double().add_(0.5).mul_(1.0 / 4294967296.0)                   # (0, 1), 32 bits
    return u.log_().neg_().log_().neg_()                                # -log(-log u)


def coupled_sample(probs: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    """[rows, vocab_size] probabilities -> [rows] tokens argmax(log p + g(seed, position)).

    Called with the target's p (the emitted token) and with the draft's q (its proposal); the
    same (seed, position) gives the same noise in both, which is the coupling.
    """
    if probs.shape[0] == 0:
        return torch.empty(0, dtype=torch.long, device=probs.device)
    g = gumbel_noise(row_keys(seeds, positions, probs.device), probs.shape[1])
    return (probs.double().log() + g).argmax(dim=-1)


def coupled_seed(params) -> int | None:
    """The seed when this request samples with the coupling (seeded, not greedy), else None."""
    return None if params.seed is None or params.greedy else params.seed


def couple_rows(tokens: torch.Tensor, probs: torch.Tensor, seeds: list, positions: list[int]):
    """Replace tokens[r] by the coupled sample of probs[r] for every row r with a seed.

    tokens: [rows] long; probs: [rows, vocab_size]; seeds: [rows] int or None (row keeps its
    token); positions: [rows] absolute position of the token each row chooses.
    """
    rows = [r for r, s in enumerate(seeds) if s is not None]
    if rows:
        idx = upload(rows, torch.long, tokens.device)
        tokens = tokens.clone().index_copy_(0, idx, coupled_sample(
            probs.index_select(0, idx), [seeds[r] for r in rows], [positions[r] for r in rows]))
    return tokens
