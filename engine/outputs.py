"""What the engine hands back: per-request deltas and a snapshot of its load."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import FinishReason, Mode


@dataclass
class RequestOutput:
    request_id: str
    text: str                          # new text since the last output (may be "")
    token_ids: list[int]               # new tokens since the last output
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    mode: Mode                         # the mode the request runs in now (may have dropped)
    acceptance_rate: float | None = None          # accepted / drafted (DESIGN.md)
    mean_acceptance_length: float | None = None   # 1 + accepted / drafts
    token_acceptance: float | None = None         # a = accepted / (accepted + rejections)
    kv_target_bytes: int = 0                      # KV this request holds now, target and draft
    kv_draft_bytes: int = 0
    num_speculative_tokens: int = 0   # output tokens emitted while in speculative mode (billing)
    num_draft_tokens: int = 0         # draft tokens proposed / accepted so far (cumulative)
    num_accepted_tokens: int = 0
    reason: str | None = None                     # e.g. "draft_unavailable": now baseline
    error: str | None = None                      # the request failed (finish_reason "error")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_speculative: int
    kv_budget_bytes: int
    kv_used_target_bytes: int
    kv_used_draft_bytes: int
    acceptance_rate: float | None          # accepted / drafted since start
    max_model_len: int
    cost_model: dict = field(default_factory=dict)
    token_acceptance: float | None = None  # the engine's live per-token estimate a (EWMA)
    speculating_acceptance: list[float] = field(default_factory=list)  # a per speculating seq
