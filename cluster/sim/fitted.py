"""The simulator's "true" step times for the 70B scenarios, fitted to published measurements,
and the "believed" model an engine would price drafting with (the truth, or off by a factor).

The simulator times every step with the true model; the simulated engine picks k and reports
`EngineStats.cost` from its believed model (calibrated online as `LLMEngine` does), and the
router's policy sees only that. `FittedStepCost` is a `engine.step_cost.StepCostModel`:

  target_s = fixed + per_seq * seqs + per_token * query tokens + per_ctx * context tokens
  draft_s  = max(draft floor, the same four terms for the draft)

Sources (A100-SXM4-80GB, fp16, Llama-2-70B TP4, published figures):
  - lmdeploy's A100 fp16 static-inference tables (docs/en/benchmark, TurboMind, llama2-70b,
    tp 4): batch 1 decode 29 ms per token; batch 64 decode 43-55 ms per step, the range over
    the table's output lengths (we read 43 ms at ~128 tokens of context per sequence and 55 ms
    at ~2,048).
  - TensorRT-LLM 0.5 docs/source/performance.md (A100, llama-70b tp4, batch 1, input 128):
    first-token latency 47 ms, i.e. a 128-token prefill.
  - The draft (Llama-2-7B) at c = draft step / target step ~ 0.22 when sharded over the same
    four GPUs (the figure speculative-decoding serving reports give; the datasheet roofline,
    `engine/hardware.py`, gives 0.13): 6.4 ms at batch 1, which is also its latency floor (32 layers of
    kernel launches and two all-reduces each do not get cheaper with fewer FLOPs). Whole on one
    A100 the 7B reads 13.5 GB of weights per step: 13.5 GB / (2.04 TB/s x 0.9 achieved) = 7.4 ms
    plus launches, ~9.5 ms (derived, not a published point: c ~ 0.33).
Derived slopes: per_token = (47 - 29) / 127 ms = 0.142 ms (the compute-bound slope: 2 x 69e9
FLOPs / 4 GPUs / 0.142 ms = 243 TFLOP/s per GPU, 78% of the A100's 312); per_ctx from 43 -> 55
ms over 8,192 -> 131,072 context tokens (~2x the bandwidth roofline's 45 ns/token); per_seq
from batch 1 -> 64 at short context. The draft's per-token and per-context slopes are the
target's scaled by FLOPs (7B / 70B) and KV bytes per GPU (MHA 7B: 1.6x the GQA 70B's).
A linear per-token term overcharges a memory-bound verify of a few tokens by ~0.1 ms a token
(0.6 ms of 29 at k = 4, batch 1): small, and on the side of not speculating.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.step_cost import LinearCost


@dataclass(frozen=True)
class FittedStepCost:
    """Linear target and draft step times with a draft latency floor (seconds)."""

    target: LinearCost
    draft: LinearCost | None
    draft_floor_s: float = 0.0

    def target_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        return self.target(num_seqs, num_tokens, context_tokens) if num_tokens > 0 else 0.0

    def draft_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        if self.draft is None:
            raise ValueError("FittedStepCost has no draft model")
        if num_tokens <= 0:
            return 0.0
        return max(self.draft_floor_s, self.draft(num_seqs, num_tokens, context_tokens))

    def to_dict(self) -> dict:
        return {"target": vars(self.target), "draft": self.draft and vars(self.draft),
                "draft_floor_s": self.draft_floor_s}

    def mismatched(self, m: float) -> "FittedStepCost":
        """What an engine believes if it prices the draft (1 + m) times what it costs (every
        draft term and the floor; c off by the same factor, the kind of error a datasheet
        roofline makes); the target as it is. m = 0: the truth."""
        if m == 0:
            return self
        s = 1.0 + m
        draft = self.draft and LinearCost(*(s * x for x in vars(self.draft).values()))
        return replace(self, draft=draft, draft_floor_s=s * self.draft_floor_s)


# Llama-2-70B TP4 on A100-80GB (see the module docstring for each number's source).
_70B_TP4_A100 = LinearCost(fixed_s=28.78e-3, per_seq_s=0.068e-3, per_token_s=0.142e-3,
                           per_ctx_token_s=0.098e-6)
# Llama-2-7B draft sharded over the same 4 GPUs (c ~ 0.22) or whole on GPU 0 (c ~ 0.33).
_7B_TP4_A100 = LinearCost(fixed_s=5.0e-3, per_seq_s=0.02e-3, per_token_s=0.0142e-3, per_ctx_token_s=0.16e-6)
_7B_TP1_A100 = LinearCost(fixed_s=9.0e-3, per_seq_s=0.05e-3, per_token_s=0.057e-3, per_ctx_token_s=0.64e-6)
# Llama-3-8B on one A100 (the small tier): the 7B's single-GPU fit plus 1 GB more weights
# (the 128k vocabulary) and GQA KV (a quarter of the 7B's per context token).
_8B_TP1_A100 = LinearCost(fixed_s=10.0e-3, per_seq_s=0.05e-3, per_token_s=0.065e-3, per_ctx_token_s=0.16e-6)

FITTED: dict[tuple[str, str, int, int], FittedStepCost] = {
    # (gpu, target, tp, draft_tp) -> true step times; draft_tp 0: no draft
    ("A100-80GB", "Llama-2-70B", 4, 4): FittedStepCost(_70B_TP4_A100, _7B_TP4_A100, 6.4e-3),
    ("A100-80GB", "Llama-2-70B", 4, 1): FittedStepCost(_70B_TP4_A100, _7B_TP1_A100, 9.5e-3),
    ("A100-80GB", "Llama-2-70B", 4, 0): FittedStepCost(_70B_TP4_A100, None),
    ("A100-80GB", "Llama-3-8B", 1, 0): FittedStepCost(_8B_TP1_A100, None),
}
