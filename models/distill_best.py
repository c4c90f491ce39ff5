"""The weights a distillation run keeps: the best validation step the swap's guard would take.

Owns: scoring the student on the validation rows at each offer (`models/distill_train.py`
offers it every `eval_every_s` and at the end), per class; the choice among the offers
(`guarded_best`); the kept weights and the scores so far on disk, so a resumed run still
knows them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models.distill import DistillData, served_acceptance
from models.distill_report import MAX_DROP


class Best:
    """The best student so far by validation acceptance at the served temperature (all classes,
    token-weighted) among those the swap's guard would take (`guarded_best`: no class's
    validation acceptance more than `max_drop` below the given student's): its weights in
    `path` (rewritten only when beaten), its step, score and every score so far beside it
    (`path` with .json), so a resumed run still knows them."""

    def __init__(self, path: Path, target, val: DistillData, temperatures: list[float],
                 drops: dict[str, float]):
        self.path, self.target, self.val, self.temperatures = path, target, val, temperatures
        self.drops = drops
        self.record = path.with_suffix(".json")
        self.step, self.score, self.history = None, float("-inf"), []
        if self.record.exists():
            saved = json.loads(self.record.read_text())
            self.step, self.score, self.history = saved["step"], saved["score"], saved["history"]

    def offer(self, step: int, module) -> None:
        if not self.val.classes:
            self.step, self.score = step, float("nan")
            return
        module.eval()
        scores = served_acceptance(self.target, module, self.val, self.temperatures)
        module.train()
        self.history.append([step, scores["all"]["acceptance"],
                             {c: v["acceptance"] for c, v in scores.items() if c != "all"}])
        kept = guarded_best(self.history, MAX_DROP, self.drops)
        if kept[0] == step:
            self.step, self.score = kept
            torch.save({k: v.detach().float().clone() for k, v in module.state_dict().items()}, self.path)
        self.record.write_text(json.dumps({"step": self.step, "score": self.score, "history": self.history}))

    def state(self) -> dict | None:
        """The kept weights (fp32), or None without a validation set (the last weights stand)."""
        return torch.load(self.path) if self.val.classes and self.path.exists() else None


def guarded_best(history: list[list], max_drop: float = MAX_DROP,
                 drops: dict[str, float] | None = None) -> list | None:
    """[step, score] of the best-scoring offer in `history` ([step, score, {class: acceptance}],
    the first one the student as given) whose classes each stay within `max_drop` (or the
    class's own in `drops`) of the first's; the earliest of equal scores. By the overall score
    alone, early stopping keeps weights the swap's guard then refuses: the traffic's classes
    keep rising while the replayed class has already fallen
    (docs/decisions/0033-alignment-loop.md)."""
    if not history:
        return None
    first, best, drops = _classes(history[0]), None, drops or {}
    for entry in history:
        step, score, classes = entry[0], entry[1], _classes(entry)
        fell = [c for c in first if c in classes
                and classes[c] < first[c] - drops.get(c, max_drop)]
        if not fell and (best is None or score > best[1]):
            best = [step, score]
    return best


def _classes(entry: list) -> dict:
    return entry[2] if len(entry) > 2 else {}      # a record from before classes were kept
