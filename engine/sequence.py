"""One request's state inside the engine.

Owns: the token ids (prompt then output), how many of them have KV in the target's and the
draft's cache, the blocks holding that KV, the request's mode, and its live acceptance counts.
Does not own: scheduling decisions (`engine/scheduler.py`) or text (`engine/detokenizer.py`).

Invariant between steps: the target has KV for `token_ids[:num_computed]` and the last token is
pending (fed in the next step), so a decoding sequence has `num_computed == len(token_ids) - 1`.
The draft has KV for `token_ids[:draft_computed]`; it may lag (it catches up when it next
proposes), which is what makes k = 0 steps free for a speculative sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from engine.sampling_params import FinishReason, Mode, RequestOptions, SamplingParams


class Status(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    options: RequestOptions
    arrival: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_ids)
        self.num_prompt = len(self.prompt_ids)
        self.num_computed = 0                 # target KV holds token_ids[:num_computed]
        self.prefill_end = self.num_prompt    # tokens fed as prompt chunks (recompute: all)
        self.draft_computed = 0               # draft KV holds token_ids[:draft_computed]
        self.blocks: list[int] = []           # target KV blocks
        self.draft_blocks: list[int] = []     # draft KV blocks (speculative mode only)
        # prefix-cache keys of full blocks (engine/prefix_cache.py), and how many of the
        # blocks held are keyed already
        self.block_keys: list[bytes] = []
        self.draft_keys: list[bytes] = []
        self.draft_keys_root = b""            # the draft root draft_keys were made under
        self.num_keyed = 0
        self.num_draft_keyed = 0
        self.mode = self.options.mode         # may drop to BASELINE; never rises back
        self.reason: str | None = None        # why the mode dropped, when the caller must know
        self.status = Status.WAITING
        self.finish_reason: FinishReason | None = None
        self.generator: torch.Generator | None = None
        self.processor = None                 # engine/logits_processors.py, when params ask
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        # Live acceptance (docs/architecture.md, "Vocabulary").
        self.num_drafts = 0                   # steps in which this sequence drafted (k > 0)
        self.num_draft_tokens = 0
        self.num_accepted = 0
        self.num_rejections = 0               # drafting steps that ended in a rejection
        self.num_preemptions = 0
        self.num_speculative_output = 0       # output tokens emitted while in speculative mode
        # Prompt log-probabilities, when asked: the first prompt token has none (None); filled
        # as prefill chunks score the rest, and handed out with the first output.
        self.prompt_logprobs: list | None = [None] if self.params.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = False

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def speculative(self) -> bool:
        return self.mode == Mode.SPECULATIVE

    @property
    def in_prefill(self) -> bool:
        """Prompt tokens (or, after a preemption, all tokens so far) are still to be fed to the
        target, in chunks; a chunk may be the last token alone, which then is still a prompt
        chunk, never a decode: its KV must not depend on where the scheduler cut."""
        return self.num_computed < self.prefill_end

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def token_acceptance(self) -> float | None:
        trials = self.num_accepted + self.num_rejections
        return self.num_accepted / trials if trials else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted / self.num_drafts if self.num_drafts else None

    def record_step(self, k: int, accepted: int) -> None:
        if k:
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted += accepted
            self.num_rejections += accepted < k

    def reset_for_recompute(self) -> None:
        """After preemption: KV is gone; the tokens so far are prefilled again later."""
        self.num_computed = 0
        self.prefill_end = len(self.token_ids)
        self.draft_computed = 0
        self.status = Status.WAITING
        self.num_preemptions += 1
