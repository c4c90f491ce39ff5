"""Log-probabilities on the wire: the replica's entries as OpenAI's chat and completions shapes.

An entry (built on the replica, `engine.logprobs.wire_entries`) is plain data:
`(token, bytes, logprob, [(token, bytes, logprob), ...])`, the alternatives best first; a
prompt's first token has logprob and alternatives None (nothing precedes it). Chat answers
`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}` with exactly the asked
number of alternatives (as OpenAI). Completions answer `{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}`, each `top_logprobs` dict holding the alternatives and the
chosen token itself (as vLLM), and `text_offset` each token's start in the choice's text
(the echoed prompt counts). Owns no values: docs/decisions/0025-logprobs.md defines them.
"""

from __future__ import annotations


def _chat_entry(entry) -> dict:
    token, raw, logprob, top = entry
    return {"token": token, "logprob": logprob, "bytes": raw,
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, b, lp in top]}


class ChoiceLogprobs:
    """One choice's `logprobs`, chunk by chunk (a stream) or summed over chunks (one body)."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.offset = 0            # completions: characters of text before the next token

    def part(self, entries: list) -> dict:
        """The `logprobs` of one chunk's tokens (entries in order)."""
        if self.chat:
            return {"content": [_chat_entry(e) for e in entries]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, _, logprob, top in entries:
            out["tokens"].append(token)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(None if top is None
                                       else {**{t: lp for t, _, lp in top}, token: logprob})
            out["text_offset"].append(self.offset)
            self.offset += len(token)
        return out


def merge(a: dict | None, b: dict | None) -> dict | None:
    """Two consecutive chunks' `logprobs` as one (lists joined field by field)."""
    if a is None or b is None:
        return a if b is None else b
    return {key: a[key] + b[key] for key in a}


def chunk_logprobs(view: ChoiceLogprobs | None, chunk) -> dict | None:
    """A `GenerateChunk`'s `logprobs` field (its prompt's entries first, for echo); None when
    the request did not ask or the chunk has no tokens."""
    if view is None:
        return None
    entries = (chunk.prompt_logprobs or []) + (chunk.logprobs or [])
    return view.part(entries) if entries else None
