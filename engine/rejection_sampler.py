"""Speculative sampling's accept/reject rule, vectorised over a batch.

Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative Decoding" (2022),
and Chen et al., "Accelerating LLM Decoding with Speculative Sampling" (2023). For one sequence
the draft proposed x_1..x_k sampled from q (draft probabilities); the target computed p (target
probabilities) at the k+1 positions in one forward. Then, position by position:

- a draft token x_i is **accepted** with probability min(1, p_i(x_i) / q_i(x_i));
- at the first rejection, one **recovered** token is sampled from normalise(max(0, p_i - q_i));
- if all k are accepted, one **bonus** token is sampled from p_{k+1}.

So each step emits accepted + 1 tokens and the output has exactly the target's distribution.
Greedy requests are the T -> 0 limit: accept while the target's argmax equals the draft token,
and the recovered/bonus token is the target's argmax.

Layout (as vLLM's rejection sampler): drafts are stored flat, sequence after sequence, indexed by
cumulative counts. With k_i drafts for sequence i, `cu_draft[i] = sum(k_j for j < i)`; the target
has k_i + 1 rows for sequence i, starting at row `cu_draft[i] + i`.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from engine.host_sync import upload
from engine.sampler import exponential_noise


def rejection_sample(
    draft_ids: torch.Tensor,          # [num_draft_tokens] long
    num_drafts: list[int],            # [batch_size] k_i, may be 0
    target_logits_argmax: torch.Tensor,  # [num_draft_tokens + batch_size] long
    greedy: list[bool],               # [batch_size]
    target_probs: torch.Tensor | None,   # [num_draft_tokens + batch_size, vocab_size] or None if all greedy
    draft_probs: torch.Tensor | None,    # [num_draft_tokens, vocab_size] or None if all greedy
    uniform: torch.Tensor | None,        # [num_draft_tokens] U(0,1), drawn per sequence
    generators: list,                 # [batch_size] generator per sequence (None: global)
) -> tuple[list[int], list[list[int]]]:
    """Returns (accepted count per sequence, emitted tokens per sequence = accepted + 1).

    Everything up to the result stays on the device; the result is read in one transfer (the
    step's one host read, `engine/host_sync.py`)."""
    device = target_logits_argmax.device
    batch, num_draft_tokens = len(num_drafts), sum(num_drafts)
    # seq_of[t]: the sequence of draft token t; pos[t]: its place among that sequence's drafts
    seq_of = [i for i, n in enumerate(num_drafts) for _ in range(n)]
    pos = [j for n in num_drafts for j in range(n)]
    cu_draft = list(accumulate(num_drafts, initial=0))[:-1]           # first draft of each
    host = upload([num_drafts, cu_draft, [int(g) for g in greedy]], torch.long, device)
    k, cu_draft_t, greedy_t = host[0], host[1], host[2].bool()                  # [batch_size]
    cu_target = cu_draft_t + torch.arange(batch, device=device)                 # [batch_size]

    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    if num_draft_tokens:
        seq_of_t, pos_t = upload([seq_of, pos], torch.long, device)             # [num_draft_tokens]
        target_row = torch.arange(num_draft_tokens, device=device) + seq_of_t   # [num_draft_tokens]
        accept = target_logits_argmax[target_row] == draft_ids
        if target_probs is not None:
            p = target_probs[target_row, draft_ids]
            q = draft_probs[torch.arange(num_draft_tokens, device=device), draft_ids]
            accept = torch.where(greedy_t[seq_of_t], accept, uniform * q < p)   # u < p/q, strict
        # Leading run of accepts per sequence: padded [batch_size, k_max] then cumprod.
        padded = torch.zeros(batch, max(num_drafts), dtype=torch.long, device=device)
        padded[seq_of_t, pos_t] = accept.long()
        num_accepted = padded.cumprod(dim=1).sum(dim=1)

    final_row = cu_target + num_accepted                                       # [batch_size]
    final = target_logits_argmax[final_row]
    if target_probs is not None and not all(greedy):
        weights = target_probs[final_row]                                      # bonus: p_{k+1}
        if num_draft_tokens:    # a rejected draft: the residual normalise(max(0, p - q))
            draft_row = (cu_draft_t + num_accepted).clamp_(max=num_draft_tokens - 1)
            residual = (weights - draft_probs[draft_row]).clamp_(min=0.0)
            # p == q at the rejected row leaves no residual: sample from p
            use = (num_accepted < k) & (residual.sum(-1) > 0)
            weights = torch.where(use[:, None], residual, weights)
        noise = exponential_noise(batch, weights.shape[1], generators, device)
        sampled = (weights / noise).argmax(dim=-1)
        final = torch.where(greedy_t, final, sampled)

    flat = torch.cat([num_accepted, final, draft_ids]).tolist()     # the one read
    accepted_list, final_list, ids = flat[:batch], flat[batch:2 * batch], flat[2 * batch:]
    out = []
    for i in range(batch):
        start = cu_draft[i]
        out.append(ids[start:start + accepted_list[i]] + [final_list[i]])
    return accepted_list, out
