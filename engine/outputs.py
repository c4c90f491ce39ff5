"""What the engine hands back: per-request deltas and a snapshot of its load."""

from __future__ import annotations

from dataclasses import dataclass

from engine.calibration import CalibratedCost
from engine.metrics import ServingTimes
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
    acceptance_rate: float | None = None          # accepted / drafted (docs/architecture.md)
    mean_acceptance_length: float | None = None   # 1 + accepted / drafts
    token_acceptance: float | None = None         # a = accepted / (accepted + rejections)
    kv_target_bytes: int = 0                      # KV this request holds now, target and draft
    kv_draft_bytes: int = 0
    num_speculative_tokens: int = 0   # output tokens emitted while in speculative mode (billing)
    num_draft_tokens: int = 0         # draft tokens proposed / accepted so far (cumulative)
    num_accepted_tokens: int = 0
    num_draft_trials: int = 0         # draft tokens tried: accepted + rejections (cumulative)
    reason: str | None = None                     # e.g. "draft_unavailable": now baseline
    error: str | None = None                      # the request failed (finish_reason "error")
    error_param: str | None = None    # ... because of this request field: refused (HTTP 400)
    logprobs: list | None = None          # [TokenLogprob] per new token, when asked
    prompt_logprobs: list | None = None   # [None, TokenLogprob...] per prompt token, first output only
    logits: object = None                 # RequestOptions.keep_logits: [new tokens, vocab] bf16 tensor


@dataclass
class EngineStats:
    """One engine's load and what the router's policy needs from it, at one moment.

    The only stats record on the way back up (docs/architecture.md, "The stats' way back
    up"): a replica's `record_routing_stats()` returns it as is, Ray carries it to the callers'
    request routers, and `router.observer.Observer` turns it into the policy's `ClusterStats`;
    the simulator's replicas emit it too. Pure Python (pickled by Ray; the ingress never
    imports torch).
    """

    num_running: int
    num_waiting: int
    num_speculative: int                   # running sequences in speculative mode
    kv_budget_bytes: int
    kv_used_target_bytes: int
    kv_used_draft_bytes: int
    target_kv_bytes_per_token: float       # what one target token charges the budget (this rank)
    draft_kv_bytes_per_token: float        # the same for the draft; 0: no draft
    context_tokens: int                    # tokens of the running sequences (KV they attend over)
    max_model_len: int
    cost: CalibratedCost | None = None     # the step cost the engine runs on, calibrated
    acceptance_rate: float | None = None   # accepted / drafted since start (the dashboard's)
    token_acceptance: float | None = None  # the engine's live per-token estimate a (None: none yet)
    speculating_acceptance: tuple[float, ...] = ()   # a of each speculating sequence
    time: float = 0.0                      # when measured (time.time() on the engine's host)
    kv_peak_target_bytes: int = 0          # the most KV in use at any step of the last
    kv_peak_draft_bytes: int = 0           # KV_PEAK_WINDOW_S (engine/metrics.py), now included
    available: bool = True                 # False: the engine loop died (being replaced)
    serving: ServingTimes | None = None    # steps against their profile, loop gaps, requests
    drafting_pays: bool | None = None      # what drafting delivered at the live acceptance,
    #   measured (engine/goodput.py): True pays, False loses to plain decoding, None not judged
    prefix_cache_queries: int = 0          # prompt tokens looked up in the prefix cache, since
    prefix_cache_hits: int = 0             # start, and of them found cached (prefill skipped)
    draft: str | None = None               # the draft it serves (its folder; None: none)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def kv_headroom_bytes(self) -> int:
        return max(0, self.kv_budget_bytes - self.kv_used_target_bytes - self.kv_used_draft_bytes)
