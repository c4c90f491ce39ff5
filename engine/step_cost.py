"""Step-cost models: what one target forward and one draft forward cost, and what a step costs.

Pure Python (no torch, no Ray, no numpy), so the engine, the router's policy and the capacity
simulator all import it cheaply. Does not own: what the engine learns while serving
(`engine/calibration.py`) nor the choice of k (`engine/k_rule.py`).

Vocabulary (docs/architecture.md): a *step* is one target forward over a batch, preceded by up to
k draft rounds. A step-cost model answers two questions, both in seconds:
  target_s(num_seqs, num_tokens, context_tokens)  one target forward over num_seqs sequences
      carrying num_tokens query tokens in total and reading context_tokens KV tokens in total;
  draft_s(num_seqs, num_tokens, context_tokens)    one draft forward, same meaning.
Implementations: `TableCost`/`TableStepCost`, step times the engine measures on a grid at start
(cached as JSON) and interpolates; `LinearCost`/`LinearStepCost`, linear in batch, tokens and
context (the engine's default without a profile, the local simulator's fit); `RooflineStepCost`
(`engine/hardware.py`), derived from datasheet presets for machines we cannot run on.
`price_step` is the one formula for a step's time from such a model; `step_parts` and `step_s`
are its two views, and `choose_k` prices its candidates with it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol, Sequence


class StepCostModel(Protocol):
    def target_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float: ...

    def draft_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float: ...


# ----------------------------------------------------------------------------- fitted (linear)


@dataclass
class LinearCost:
    """seconds = fixed_s + per_seq_s * num_seqs + per_token_s * num_tokens + per_ctx_token_s * ctx."""

    fixed_s: float
    per_seq_s: float
    per_token_s: float
    per_ctx_token_s: float = 0.0

    def __call__(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        return (self.fixed_s + self.per_seq_s * num_seqs + self.per_token_s * num_tokens
                + self.per_ctx_token_s * context_tokens)


@dataclass
class LinearStepCost:
    """A StepCostModel from two fitted LinearCosts; the engine caches it as JSON."""

    target: LinearCost
    draft: LinearCost

    def target_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        return self.target(num_seqs, num_tokens, context_tokens)

    def draft_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        return self.draft(num_seqs, num_tokens, context_tokens)

    def to_dict(self) -> dict:
        return {"target": asdict(self.target), "draft": asdict(self.draft)}

    @classmethod
    def from_dict(cls, d: dict) -> "LinearStepCost":
        return cls(target=LinearCost(**d["target"]), draft=LinearCost(**d["draft"]))


@dataclass
class TableCost:
    """seconds measured on a grid, interpolated: rows by num_seqs, points by tokens per sequence.

    A linear fit cannot hold a step whose cost is flat while the matmuls are bound by reading
    weights and then grows once they are bound by compute (on the CPU with oneDNN, 1 to 8 query
    tokens of one sequence cost nearly the same); the table keeps that shape. Between grid
    points it interpolates linearly; beyond them it extrapolates the last segment.
    rows: {num_seqs: [(tokens_per_seq, seconds), ...]} with at least one row of two points.
    """

    rows: dict[int, list[tuple[float, float]]]

    def __post_init__(self) -> None:
        self.rows = {int(n): sorted((float(q), float(t)) for q, t in pts)
                     for n, pts in self.rows.items()}
        self._seqs = sorted(self.rows)

    @staticmethod
    def _interp(points: list[tuple[float, float]], x: float) -> float:
        if len(points) == 1:
            return points[0][1]
        i = 1
        while i < len(points) - 1 and points[i][0] < x:
            i += 1
        (x0, y0), (x1, y1) = points[i - 1], points[i]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))

    def __call__(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        if num_seqs <= 0:
            return 0.0
        per_seq = num_tokens / num_seqs
        row = {n: self._interp(self.rows[n], per_seq) for n in self._seqs}
        return self._interp([(float(n), row[n]) for n in self._seqs], float(num_seqs))

    @classmethod
    def measure_grid(cls, samples: Sequence[tuple[int, int, int, float]]) -> "TableCost":
        """From (num_seqs, num_tokens, context_tokens, seconds) samples on a grid."""
        rows: dict[int, list[tuple[float, float]]] = {}
        for n, t, _, secs in samples:
            rows.setdefault(n, []).append((t / n, secs))
        return cls(rows)


@dataclass
class TableStepCost:
    """A StepCostModel from two measured tables; the engine caches it as JSON."""

    target: TableCost
    draft: TableCost | None = None

    def target_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        return self.target(num_seqs, num_tokens, context_tokens)

    def draft_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        return self.draft(num_seqs, num_tokens, context_tokens) if self.draft else 0.0

    def to_dict(self) -> dict:
        return {"kind": "table", "target": {str(n): p for n, p in self.target.rows.items()},
                "draft": {str(n): p for n, p in self.draft.rows.items()} if self.draft else None}

    @classmethod
    def from_dict(cls, d: dict) -> "TableStepCost":
        return cls(TableCost(d["target"]), TableCost(d["draft"]) if d.get("draft") else None)


# ----------------------------------------------------------------------------- a step's time


def price_step(cost: StepCostModel, num_seqs: int, query_tokens: int, rounds: Sequence[int],
               context_tokens: int = 0, first_round_tokens: int | None = None) -> tuple[float, float]:
    """(draft rounds, verify forward) of one step, in seconds: the step-time formula.

    One target forward over `num_seqs` sequences carrying `query_tokens` (prompt chunks, fed
    tokens and drafts), after the draft rounds: round j runs over rounds[j - 1] sequences (those
    drafting at least j tokens, `draft_rounds`), one token each, except that the first feeds
    `first_round_tokens` when given (what each draft had not read yet: one token when on time,
    a prompt it never saw). A round reads its sequences' share of the context.
    """
    verify = cost.target_s(num_seqs, query_tokens, context_tokens)
    drafting = 0.0
    for j, n_j in enumerate(rounds):
        fed = first_round_tokens if j == 0 and first_round_tokens is not None else n_j
        drafting += cost.draft_s(n_j, fed, context_tokens * n_j // max(num_seqs, 1))
    return drafting, verify


def draft_rounds(ks: Sequence[int]) -> list[int]:
    """[n_1, ..., n_max(ks)]: n_j = the sequences drafting at least j tokens (round j's batch)."""
    return [sum(1 for k in ks if k >= j) for j in range(1, max(ks, default=0) + 1)]


def step_parts(cost: StepCostModel, ks: Sequence[int], num_seqs: int, query_tokens: int,
               first_round_tokens: int, context_tokens: int = 0) -> tuple[float, float]:
    """(draft rounds, verify forward) of one step as run, sequence i drafting ks[i] tokens
    (`price_step`). The engine prices each step it runs with this (`ServingTimes`, what the
    served steps took against their profile) and the simulator's engines time theirs."""
    return price_step(cost, num_seqs, query_tokens, draft_rounds(ks), context_tokens,
                      first_round_tokens)


def step_s(ks: Sequence[int], cost: StepCostModel, context_tokens: int = 0,
           extra_tokens: int = 0) -> float:
    """Time of one decode step where sequence i drafts ks[i] tokens, each draft on time
    (`price_step`): max(ks) draft rounds, then one target verify over all sequences carrying
    sum(k + 1) + extra_tokens query tokens."""
    batch = len(ks)
    drafting, verify = price_step(cost, batch, batch + sum(ks) + extra_tokens, draft_rounds(ks),
                                  context_tokens)
    return verify + drafting
