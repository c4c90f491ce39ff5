"""Log-probabilities a request asked for: the target's, at the rows the step already computed.

Owns: the definition (docs/decisions/0025-logprobs.md): a row's log-probabilities are the
log-softmax of the target's logits for that row after the request's logits processing and
BEFORE temperature, top-k and top-p, so a greedy request gets the model's own distribution.
`row_logprobs` is the one place they are computed; it takes the same logits tensor that feeds
`probabilities()` / `greedy_tokens()` in `engine/spec_decode.py`, so a logits processor placed
before those also shapes these. Also owns which prompt positions a prefill chunk scores
(`prompt_rows`). Does not own tokens as text (the replica's tokenizer does) nor the wire shapes
(`router/logprobs.py`).

Cost: only rows of requests that asked are passed here, one log-softmax per row; the other rows
of the step never reach it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

@dataclass
class TokenLogprob:
    """One position: the token that stands there, its log-probability, and the best others."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]     # (token id, log-probability), best first


def row_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """logits [num_rows, vocab_size] (the target's, before temperature / top-k / top-p),
    token_ids [num_rows] the token each row scores, num_top [num_rows] how many alternatives
    each row returns -> one `TokenLogprob` per row."""
    if not token_ids:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)                       # [num_rows, vocab]
    ids = torch.tensor(token_ids, dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
    width = max(num_top)
    top_vals, top_ids = (logp.topk(width, dim=-1, sorted=True) if width
                         else (logp[:, :0], logp[:, :0].long()))
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return [TokenLogprob(t, lp, list(zip(ti[:n], tv[:n])))
            for t, lp, ti, tv, n in zip(token_ids, chosen, top_ids, top_vals, num_top)]


def prompt_rows(num_scored: int, start: int, num_feed: int, num_prompt: int) -> range:
    """Positions of a prefill chunk whose row scores a prompt token: the chunk feeds positions
    [start, start + num_feed); position i predicts token i + 1, so it scores a prompt token while
    i + 1 < num_prompt. Positions whose token is already scored (`num_scored` prompt tokens,
    counting the first, which has none: a recompute after preemption) are left out."""
    return range(max(start, num_scored - 1), min(start + num_feed, num_prompt - 1))


def wire_entries(tokenizer, entries: list) -> list[tuple]:
    """`TokenLogprob`s as the plain
    tuples `router/logprobs.py` shapes: (token text, its UTF-8 bytes, logprob, [(text, bytes,
    logprob)] best first). A token's text is its own decode."""
    def text(token_id: int) -> tuple[str, list[int]]:
        s = tokenizer.decode([token_id])
        return s, list(s.encode("utf-8"))

    return [(*text(e.token_id), e.logprob, [(*text(i), lp) for i, lp in e.top])
            for e in entries]


def wire_prompt(tokenizer, prompt_ids: list[int], entries: list) -> list[tuple]:
    """A prompt's entries for the wire: its first token with logprob and alternatives None."""
    s = tokenizer.decode([prompt_ids[0]])
    return [(s, list(s.encode("utf-8")), None, None)] + wire_entries(tokenizer, entries[1:])
