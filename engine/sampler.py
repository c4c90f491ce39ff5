"""Turning logits into the distributions and tokens a request asked for.

Owns: temperature, top-k and top-p applied row by row (the same function serves the target and
the draft, so both distributions are processed alike before the accept test), and drawing from a
distribution with a per-request `torch.Generator` so a seeded request is reproducible.
Does not own: the accept/reject rule (`engine/rejection_sampler.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.host_sync import upload
from engine.sampling_params import GREEDY_BELOW


@dataclass
class RowParams:
    """Sampling settings for a set of rows, one entry per row: on the device for the math, and
    on the host where a branch depends on them (reading them off a GPU would wait for it)."""
    temperature: torch.Tensor        # [num_rows] float; rows with 0 are greedy
    top_k: torch.Tensor              # [num_rows] long; 0 = off
    top_p: torch.Tensor              # [num_rows] float; 1 = off
    generators: list                 # [num_rows] torch.Generator or None (engine's default)
    greedy: list[bool] | None = None  # host: the row is greedy (None: read off the tensors)
    cut: list[bool] | None = None     # host: the row cuts its tail (top-k or top-p)

    def __post_init__(self):
        if self.greedy is None:
            self.greedy = (self.temperature < GREEDY_BELOW).tolist()
        if self.cut is None:
            self.cut = ((self.top_k > 0) | (self.top_p < 1)).tolist()

    @classmethod
    def build(cls, params: list, generators: list, device) -> "RowParams":
        # A greedy request's row is exactly 0, so the row and `params.greedy` never disagree.
        return cls(temperature=upload([0.0 if p.greedy else p.temperature for p in params],
                                      torch.float32, device),
                   top_k=upload([p.top_k for p in params], torch.long, device),
                   top_p=upload([p.top_p for p in params], torch.float32, device),
                   generators=list(generators), greedy=[p.greedy for p in params],
                   cut=[p.top_k > 0 or p.top_p < 1 for p in params])

    def select(self, rows: list[int]) -> "RowParams":
        idx = upload(rows, torch.long, self.temperature.device)
        return RowParams(self.temperature[idx], self.top_k[idx], self.top_p[idx],
                         [self.generators[i] for i in rows], [self.greedy[i] for i in rows],
                         [self.cut[i] for i in rows])


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> [rows], each row's highest logit, the first of equals. `max(dim)` rather
    than `argmax`: on CPU it is about 3x faster at [32, 8192], and the engine takes one a target
    forward and one a draft round."""
    return logits.max(dim=-1).indices


def probabilities(logits: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """[num_rows, vocab_size] logits -> probabilities after temperature, top-k and top-p.

    Greedy rows (temperature below GREEDY_BELOW) get a one-hot on their argmax, the exact limit
    of T -> 0 (dividing by a tinier T would overflow to inf and NaN). Each row's top-k and top-p
    cut applies to that row alone.
    """
    logits = logits.float()
    greedy = rp.temperature < GREEDY_BELOW
    temp = torch.where(greedy, torch.ones_like(rp.temperature), rp.temperature)
    logits = logits / temp[:, None]
    if any(rp.cut):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        k = torch.where(rp.top_k > 0, rp.top_k.clamp(max=vocab), torch.full_like(rp.top_k, vocab))
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= k[:, None]                                            # beyond top-k
        sorted_probs = sorted_logits.softmax(dim=-1).masked_fill(drop, 0.0)
        sorted_probs = sorted_probs / sorted_probs.sum(-1, keepdim=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs              # mass of better tokens
        cut_p = (rp.top_p < 1)[:, None]              # rows without top-p keep their whole tail
        drop |= cut_p & (mass_before >= rp.top_p[:, None])                    # beyond top-p (keeps >= 1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if any(rp.greedy):
        one_hot = torch.zeros_like(probs).scatter_(1, greedy_tokens(logits)[:, None], 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def exponential_noise(shape_rows: int, width: int, generators: list, device) -> torch.Tensor:
    """[rows, width] of Exp(1) draws, row i from generators[i] (None: the global generator).

    Drawn as -log(U), U ~ U[0, 1): torch's `exponential_` on CPU costs several times what
    `uniform_` and `log_` do, and a step sampling at temperature 1 (the OpenAI default) draws
    one per vocabulary entry per row, for the target and every draft round. U < 1 keeps every
    draw above 0, so `w / E` never divides by 0; U = 0 (2^-24 a draw) is taken as the smallest
    positive float, so E stays finite and a row's only positive weight still wins. The rows on the global generator are drawn in one call.
    """
    noise = torch.empty(shape_rows, width, device=device)
    shared = [i for i, gen in enumerate(generators) if gen is None]
    if len(shared) == shape_rows:
        noise.uniform_()
    elif shared:
        noise.index_copy_(0, upload(shared, torch.long, device),
                          torch.rand(len(shared), width, device=device))
    for i, gen in enumerate(generators):
        if gen is None:
            continue
        if gen.device == noise.device:
            noise[i].uniform_(generator=gen)
        else:   # a seeded request's CPU generator: draw there, so the seed means the same
            noise[i] = upload(torch.rand(width, generator=gen), noise.dtype, device)
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny).log_().neg_()


def uniforms(counts: list[int], generators: list, device) -> torch.Tensor:
    """Flat U(0,1) draws: counts[i] of them from generators[i], concatenated."""
    parts = [torch.rand(n, device=device) if gen is None else
             upload(torch.rand(n, generator=gen, device=gen.device), torch.float32, device)
             for n, gen in zip(counts, generators) if n]
    return torch.cat(parts) if parts else torch.empty(0, device=device)


def sample(probs: torch.Tensor, generators: list) -> torch.Tensor:
    """One token per row from (possibly unnormalised) weights: argmax(w / E), E ~ Exp(1).

    The exponential race picks j with probability w_j / sum(w); no normalisation needed.
    """
    noise = exponential_noise(probs.shape[0], probs.shape[1], generators, probs.device)
    return (probs / noise).argmax(dim=-1)
