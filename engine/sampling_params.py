"""What a caller asks of one request: sampling settings, stop rules, mode and priority.

Owns validation of those fields (a `ValueError` with a clear message; the HTTP side turns it into
a 400). Does not own tokenization or the choice of tier (that is `router/policy.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from models import GREEDY_BELOW  # temperatures below it are greedy

MAX_TOP_LOGPROBS = 20    # alternatives per position a request may ask for (as OpenAI's chat)


class Mode(str, Enum):
    SPECULATIVE = "speculative"   # draft proposes up to k_max tokens per step; target verifies
    BASELINE = "baseline"         # plain decoding (k = 0): the target alone


class FinishReason(str, Enum):
    STOP = "stop"        # an eos token, a stop token id or a stop string
    LENGTH = "length"    # max_tokens reached (or the model's context is full)
    ABORT = "abort"      # aborted by the caller (disconnect) or the engine (shutdown)
    ERROR = "error"      # the engine failed while running it (RequestOutput.error says why)


MAX_TOP_K = 1 << 31      # top_k beyond the vocabulary is "off"; beyond this it is refused
MAX_LOGIT_BIAS = 300     # entries, as OpenAI
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)   # what torch.Generator.manual_seed takes


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Checked on construction and immutable after (the engine trusts what it validated)."""
    temperature: float = 1.0          # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0                # nucleus mass kept, (0, 1]
    top_k: int = 0                    # 0 = off
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None           # a seeded request is reproducible
    # Logits processing (engine/logits_processors.py), OpenAI's ranges and vLLM's
    # repetition_penalty; the draft's rows get the same processing as the target's.
    presence_penalty: float = 0.0     # [-2, 2], once per token id in the output so far
    frequency_penalty: float = 0.0    # [-2, 2], per occurrence in the output so far
    repetition_penalty: float = 1.0   # (0, 2], on tokens of the prompt and the output; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100])
    json_schema: str | None = None    # the output must match this JSON schema (engine/grammar.py)
    # Log-probabilities (engine/logprobs.py): None = off; n = each output token's own and its n
    # best alternatives. prompt_logprobs: the same for every prompt token (the first has none).
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be an integer in [0, {MAX_TOP_K}], got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        self._check_processing()
        low, high = SEED_RANGE
        if self.seed is not None and (not _is_int(self.seed) or not low <= self.seed <= high):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not _is_int(n) or not 0 <= n <= MAX_TOP_LOGPROBS):
                raise ValueError(f"{name} must be null or an integer in [0, {MAX_TOP_LOGPROBS}], "
                                 f"got {n!r}")

    def _check_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be a number in (0, 2], "
                             f"got {self.repetition_penalty!r}")
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, dict) else bias
        try:
            pairs = tuple(sorted((int(t) if isinstance(t, str) else t, b) for t, b in items))
        except (TypeError, ValueError):
            raise ValueError("logit_bias must map token ids to numbers") from None
        if len(pairs) > MAX_LOGIT_BIAS or not all(
                _is_int(t) and t >= 0 and _is_number(b) and -100 <= b <= 100 for t, b in pairs):
            raise ValueError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to numbers "
                             "in [-100, 100]")
        object.__setattr__(self, "logit_bias", pairs)
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise ValueError("json_schema must be a string (a JSON schema's text)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def processes_logits(self) -> bool:
        """Whether rows of this request need `engine/logits_processors.py` at all."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.json_schema is not None)


@dataclass
class RequestOptions:
    """How the engine runs a request; chosen by the router, not the caller's sampling."""
    mode: Mode = Mode.BASELINE
    k_max: int = 4          # upper bound on k per step (speculative mode); the engine adapts below it
    priority: int = 0       # higher runs first and keeps speculation longest under memory pressure
    # In-process callers only (distillation's `TargetWriter`, models/distill_rollouts.py):
    keep_logits: bool = False   # each output carries the target's logits of its new tokens
    detokenize: bool = True     # False: token ids only, no text (refused with stop strings)

    def __post_init__(self) -> None:
        self.mode = Mode(self.mode)
        if not _is_int(self.priority):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if not _is_int(self.k_max) or not 0 <= self.k_max <= 16:
            raise ValueError(f"k_max must be in 0..16, got {self.k_max}")
        for name in ("keep_logits", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
