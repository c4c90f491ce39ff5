"""The messages that cross the one network hop inside the app: ingress -> tier replica.

Plain dataclasses (pickled by Ray), no torch, so the ingress never imports the engine. A replica
turns a `GenerateRequest` into an engine call and streams `GenerateChunk`s back; anything that must
become an HTTP error is raised as a `TierError` carrying its status, so the ingress maps it
without knowing engine exception types.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerateRequest:
    request_id: str
    tier: str                                 # speculative | baseline | small
    mode: str                                 # engine Mode value: speculative | baseline
    k_max: int
    sampling: dict                            # SamplingParams keyword arguments
    prompt: str | None = None                 # completions: text ...
    prompt_token_ids: list[int] | None = None  # ... or token ids
    messages: list[dict] | None = None        # chat: [{"role", "content"}]
    priority: int = 0
    echo: bool = False                        # completions: the prompt's text comes back first
    n: int = 1                                # choices: siblings of one prompt (chunks carry index)


@dataclass
class GenerateChunk:
    text: str                                 # the delta since the previous chunk
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    mode: str = "baseline"
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    token_acceptance: float | None = None    # per-token a = accepted / (accepted + rejections)
    num_speculative_tokens: int = 0          # output tokens emitted in speculative mode (billing)
    num_draft_tokens: int = 0                # draft tokens proposed / accepted, cumulative
    num_accepted_tokens: int = 0
    num_draft_trials: int = 0                # draft tokens tried: accepted + rejections
    reason: str | None = None                # set when the engine changed the mode (draft_unavailable)
    fingerprint: str | None = None           # the replica's weights, numerics and sampler
    # Log-probabilities, when asked (router/logprobs.py has the entry's shape): one per token of
    # this chunk; the prompt's, and its text for echo, on the first chunk only.
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    prompt_text: str | None = None
    # On the last chunk: the draft the request ran with (its folder), None when it ran none or
    # the draft was swapped while it ran (router/draft_live.py attributes acceptance by it).
    draft: str | None = None
    index: int = 0                            # the choice (sibling) this chunk belongs to
    remaining: int = 0                        # siblings still running after this chunk

    @property
    def done(self) -> bool:
        """The last chunk of the request: nothing follows it."""
        return self.finished and not self.remaining


def combined(lasts: list[GenerateChunk]) -> GenerateChunk:
    """What the siblings of one request ran, as one cumulative chunk (for usage, billing and the
    observer): the prompt once, as OpenAI counts it, everything generated summed."""
    if len(lasts) == 1:
        return lasts[0]
    first = lasts[0]
    total = GenerateChunk(text="", finished=all(c.finished for c in lasts),
                          num_prompt_tokens=first.num_prompt_tokens,
                          mode="speculative" if any(c.mode == "speculative" for c in lasts)
                          else first.mode,
                          reason=next((c.reason for c in lasts if c.reason), None),
                          fingerprint=first.fingerprint,
                          draft=first.draft if all(c.draft == first.draft for c in lasts) else None)
    for name in ("num_output_tokens", "num_speculative_tokens", "num_draft_tokens",
                 "num_accepted_tokens", "num_draft_trials"):
        setattr(total, name, sum(getattr(c, name) for c in lasts))
    if total.num_draft_tokens:
        total.acceptance_rate = total.num_accepted_tokens / total.num_draft_tokens
        # 1 + accepted / proposals: the siblings' own, weighted by the draft tokens they proposed
        total.mean_acceptance_length = sum((c.mean_acceptance_length or 1) * c.num_draft_tokens
                                           for c in lasts) / total.num_draft_tokens
    if total.num_draft_trials:
        total.token_acceptance = total.num_accepted_tokens / total.num_draft_trials
    return total


class TierError(Exception):
    """An error a replica reports to the client: HTTP status, OpenAI error type and code."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 retry_after: float | None = None, replica: str | None = None):
        super().__init__(status, message, type_, code, param, retry_after, replica)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.retry_after = retry_after         # seconds (a 503's expected recovery), if known
        self.replica = replica                 # the Serve replica id that answered, if it says

    def __str__(self) -> str:
        return self.message


def find_tier_error(exc: BaseException) -> TierError | None:
    """The `TierError` inside an exception that crossed Ray (`RayTaskError` keeps a `cause`)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, TierError):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
        seen += 1
    return None
