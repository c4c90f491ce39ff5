"""The live statistics the tier policy reads: plain dataclasses, filled by `router.observer`.

The observer fills them from replicas' `EngineStats`, live or simulated, and finished requests.
This module only holds data: it imports neither torch nor Ray and decides nothing.

Memory is per replica on its *tightest* GPU (the one whose KV budget runs out first: with a
colocated whole draft, the draft's GPU). All byte counts charge against that GPU's budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.step_cost import StepCostModel

PROMPT_CLASSES = ("code", "chat", "qa", "creative")


@dataclass
class TierStats:
    """One tier's load right now (speculative and baseline share the target replicas)."""

    decode_batch_size: int = 0  # sequences in the running batch
    num_speculating: int = 0  # of those, sequences in speculative mode (holding draft KV)
    speculating_acceptance: tuple[float, ...] = ()  # the engine's a for each of those
    queue_depth: int = 0  # requests waiting for admission
    kv_headroom_bytes: int = 0  # free KV bytes on the tightest GPU
    kv_budget_bytes: int = 0  # KV budget on that GPU: memory - weights - activation reserve
    target_kv_bytes_per_token: float = 0.0  # what one token of target KV charges that GPU
    draft_kv_bytes_per_token: float = 0.0  # what one token of draft KV charges it (0: no draft)
    context_tokens: int = 0  # target KV tokens held by the running batch, all sequences
    acceptance_by_class: dict[str, float] = field(default_factory=dict)  # per-token acceptance a
    #   (accepted / (accepted + rejections), not the dashboard's accepted / drafted) per class
    acceptance_samples: tuple[float, ...] = ()  # a of recently finished speculative requests,
    #   one each: the spread the policy needs to foresee a batch's lowest acceptance
    mean_output_tokens: float = 0.0  # recent mean output length (0: unknown, use max_tokens)
    cost: StepCostModel | None = None  # step-time model; None: no draft, cannot speculate
    drafting_loses: bool = False  # the engine measured drafting delivering less than plain
    #   decoding at its live acceptance (engine/goodput.py)
    available: bool = True  # False: every replica of the tier reported itself down (its engine
    #   restarting or dead), or the tier has none left
    cold: bool = False  # no replica, as its autoscaler may leave it (min_replicas 0): a request
    #   that waits at its handle starts one

    def __post_init__(self) -> None:
        if min(self.decode_batch_size, self.num_speculating, self.queue_depth) < 0:
            raise ValueError("TierStats counts must be non-negative")
        if self.num_speculating > self.decode_batch_size:
            raise ValueError("num_speculating cannot exceed decode_batch_size")

    @property
    def can_speculate(self) -> bool:
        return self.cost is not None and self.draft_kv_bytes_per_token > 0


@dataclass
class ClusterStats:
    """tier name -> TierStats. 'speculative' and 'baseline' may be the same object (same replicas)."""

    tiers: dict[str, TierStats] = field(default_factory=dict)

    @property
    def target(self) -> TierStats:
        """Stats of the target replicas (the speculative tier's, else the baseline's)."""
        for name in ("speculative", "baseline"):
            if name in self.tiers:
                return self.tiers[name]
        raise KeyError("ClusterStats has no target tier ('speculative' or 'baseline')")

    @property
    def small(self) -> TierStats | None:
        return self.tiers.get("small")
