"""What a caller asks of one request: sampling settings, stop rules, mode and priority.

Owns validation of those fields (a `ValueError` with a clear message; the HTTP side turns it into
a 400). Does not own tokenization or the choice of tier (that is `router/policy.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Mode(str, Enum):
    SPECULATIVE = "speculative"   # draft proposes up to k_max tokens per step; target verifies
    BASELINE = "baseline"         # plain decoding (k = 0): the target alone


class FinishReason(str, Enum):
    STOP = "stop"        # an eos token, a stop token id or a stop string
    LENGTH = "length"    # max_tokens reached (or the model's context is full)
    ABORT = "abort"      # aborted by the caller (disconnect) or the engine (shutdown)


@dataclass
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0                # nucleus mass kept, (0, 1]
    top_k: int = 0                    # 0 = off
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None           # a seeded request is reproducible

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RequestOptions:
    """How the engine runs a request; chosen by the router, not the caller's sampling."""
    mode: Mode = Mode.BASELINE
    k_max: int = 4          # upper bound on k per step (speculative mode); the engine adapts below it
    priority: int = 0       # higher runs first and keeps speculation longest under memory pressure

    def __post_init__(self) -> None:
        self.mode = Mode(self.mode)
        if not 0 <= self.k_max <= 16:
            raise ValueError(f"k_max must be in 0..16, got {self.k_max}")
