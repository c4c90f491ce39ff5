"""The `alignment:` section of the app config: the closed loop's rules (router/alignment.py)
and how its rounds and canaries run (deployments/alignment_loop.py). Off by default."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from router.alignment import AlignmentConfig


class DistillRound(BaseModel):
    """One distillation round: `specserve draft distill`'s own options, on the captured prompts."""
    model_config = ConfigDict(extra="forbid")
    minutes: float | None = Field(15.0, gt=0, description="training time budget")
    steps: int | None = Field(None, ge=1, description="optimizer steps instead of minutes")
    threads: int = Field(1, ge=1, description="torch threads of the round's process")
    niceness: int = Field(19, ge=0, le=19, description="how far below the loop's own CPU "
                          "priority the round's process runs (19: the lowest, so serving keeps "
                          "its cores)")
    cpu_share: float = Field(1.0, gt=0, le=1, description="share of the time the round's "
                             "process runs: the loop stops it (SIGSTOP) for the rest of each "
                             "2 s cycle, and gives it minutes / cpu_share of wall time, so the "
                             "round's compute is the same and serving on shared cores keeps "
                             "its throughput (1: never stopped; a GPU of its own)")
    temperature: str = Field("1.0", description="served temperature(s), comma-separated")
    replay: int = Field(200, ge=0, description="general-code prompts replayed beside the class")
    replay_drop: float = Field(0.02, ge=0, lt=1, description="how far the replayed class's "
                               "held-out acceptance may fall (the served classes: 0.02, and the "
                               "canary judges them live)")
    max_prompts: int | None = Field(600, ge=1, description="distinct captured prompts a round "
                                    "takes, the newest: half of the class that triggered it, "
                                    "the rest shared by the other classes (null: all)")
    guard_prompts: str | None = Field(None, description="JSONL prompts of other traffic, scored "
                                      "before and after; a drop there refuses the draft")
    new_tokens: int = Field(64, ge=1)
    validation: float = Field(0.15, gt=0, lt=1, description="share of each class's training "
                              "prompts that picks the kept weights: the best-scoring step whose "
                              "classes each stay within the swap guard's drop, so enough of "
                              "every class (replay included) to see it fall")
    extra_args: list[str] = Field(default_factory=list, description="more `draft distill` flags")


class AlignmentSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    rules: AlignmentConfig = Field(default_factory=AlignmentConfig,
                                   description="when to distil, promote and roll back")
    dir: str = Field("~/.cache/specserve/alignment", description="rounds' drafts and "
                     "history.jsonl (`specserve draft history`)")
    period_s: float = Field(10.0, gt=0, description="how often the loop looks")
    canary_share: float = Field(0.25, gt=0, lt=1, description="share of the time the canary "
                                "draft serves, in alternating windows, until judged")
    canary_window_s: float = Field(60.0, gt=0, description="the serving draft's window; the "
                                   "canary's is canary_window_s x share / (1 - share)")
    canary_timeout_s: float = Field(3600.0, gt=0, description="no verdict by then: roll back")
    watch_s: float = Field(1800.0, ge=0, description="how long a promoted draft is watched")
    num_cpus: float = Field(0.0, ge=0, description="CPUs reserved for the loop's actor "
                            "(a round's process runs niced beside it; a GPU of its own in "
                            "production)")
    round: DistillRound = Field(default_factory=DistillRound)

    @field_validator("rules", mode="before")
    @classmethod
    def _rules(cls, value):
        if not isinstance(value, dict):
            return value
        try:
            return AlignmentConfig(**value)
        except TypeError as exc:            # an unknown key
            raise ValueError(f"alignment.rules: {exc}") from None
