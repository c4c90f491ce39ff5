"""Projections on CPU: which kernel runs them, and oneDNN calls whose rows are bit-exact.

Owns: choosing how a `[rows, in] x [out, in]^T` projection runs on this CPU (`cpu_kernel`),
laying a weight out for that kernel (`prepare`), and, for oneDNN, the per-shape row plans
(`RowPlan`) that keep every output row the bits it gets alone whatever else is in the batch.
Greedy speculative decoding's identity with plain decoding rests on that: a verify forward
runs n x (k + 1) rows where plain decoding runs n. `Linear` runs a prepared weight.
Does not own the model's math (`models/llama.py`) nor GPU projections (plain `F.linear`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

# oneDNN keeps the last 1024 kernels it built in a process; a target and its draft at every
# bucketed row count (`onednn_rows`, built by `RowPlan`) need ~1,500, and a kernel rebuilt in
# serving costs ~0.7 ms. Read at oneDNN's first use, so set on import, before any model is
# built; a value the user set wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "4096")


def cpu_kernel(dtype: torch.dtype = torch.float32) -> str:
    """How projections run on CPU (docs/decisions/0005-onednn-row-plans.md):

    - "onednn": oneDNN with weights prepacked once (the kernel torch.compile's CPU backend
      uses). Each output row is computed the same way at the row counts its `RowPlan` keeps
      calls to, so a token's logits do not depend on what else is in the batch (bitwise,
      tested), and 2-16 rows cost little more than one: verifying k + 1 tokens is nearly free.
    - "mkl": [in, out] weights through MKL (x @ W), faster than F.linear's [out, in] at one
      row; the fallback where the oneDNN ops are missing.
    - bfloat16 without oneDNN's bf16 kernels (no AVX512-BF16/AMX): F.linear ("torch"); dtype
      "auto" picks float32 on such CPUs, where bf16 is emulated and several times slower.
    """
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2, dtype=dtype), w, None, "none", [], "")
        return "onednn"
    except (AttributeError, RuntimeError, NotImplementedError):
        return "mkl" if dtype == torch.float32 else "torch"


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN projection runs at: exact up to EXACT_ROWS, above that rounded up
    to one of 8 steps an octave (at most 12.5% of padding, zero rows whose outputs are dropped).

    oneDNN builds a kernel for each new input shape (about ten times a cached call's cost) and a
    speculative or chunked-prefill batch brings a new row count nearly every step; bucketed, a
    model's ~72 row counts up to 2048 stay cached. A row's output does not depend on the other
    rows (`cpu_kernel`), so the padding changes no bit of it (tests;
    docs/decisions/0005-onednn-row-plans.md)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << max(0, rows.bit_length() - 4)          # 8 steps in (2^(e-1), 2^e]
    return -(-rows // step) * step


EXACT_ROWS = 16
PROBE_ROWS = 2048    # row counts tried for bit-exact rows (`RowPlan`); the LM head's up to
PROBE_LOGIT_ROWS = 512   # (a step's logit rows: its sequences' 1 + k); beyond, in pieces
ALONE_ROWS = 256     # rows a plan computes one at a time, the reference for calls up to that
PLAN_FORMAT = 1      # the row-plan file layout (`Linear._cached_plan`)


def _timed(run, x: torch.Tensor) -> float:
    start = time.perf_counter()
    run(x)
    return time.perf_counter() - start


class RowPlan:
    """How one oneDNN projection runs any number of rows with every row's output the bits it
    gets alone: as calls at row counts found to keep them ("good" buckets of `onednn_rows`),
    chosen to cost least.

    At some row counts oneDNN splits the sum over the input dimension differently (in bfloat16
    on AMX, and in float32 once the input is wide), and a token's logits would then depend on
    how many rows were computed beside it: a verify forward (n x (k + 1) rows) would no longer
    give what plain decoding (n rows) gives. Each bucket is tried on random rows against the
    same rows computed alone (up to ALONE_ROWS, every whole call of it among them) or in
    pieces already found exact; a row count that fails runs padded up to a good one or in good
    pieces, whichever the call times measured here price lower (a padding row priced like a
    computed one). Building a plan also builds oneDNN's kernel for every bucket, so no step
    builds one.

    run: x [m, width] -> [m, out], one oneDNN call at m rows."""

    def __init__(self, run, width: int, dtype: torch.dtype, max_rows: int):
        buckets = sorted({onednn_rows(m) for m in range(1, max_rows + 1)})
        # heavy-tailed rows: sums that cancel, so that a changed order shows in the rounded
        # output (plain normal rows miss most such changes: docs/decisions/0005-onednn-row-plans.md)
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(max(max_rows, ALONE_ROWS), width, generator=g)
             * torch.exp(2 * torch.randn(max(max_rows, ALONE_ROWS), width, generator=g))).to(dtype)
        alone = torch.cat([run(x[i:i + 1]) for i in range(ALONE_ROWS)])
        good, seconds = {}, {}
        for m in buckets:
            if m <= ALONE_ROWS:         # every whole call of m rows among the rows run alone
                good[m] = all(torch.equal(run(x[i:i + m]), alone[i:i + m])
                              for i in range(0, ALONE_ROWS - m + 1, m))
            else:                       # against pieces already found exact
                piece = max(p for p in good if good[p] and p <= ALONE_ROWS)
                ref = torch.cat([run(x[i:i + piece]) for i in range(0, m, piece)])[:m]
                good[m] = torch.equal(run(x[:m]), ref)
            seconds[m] = min(_timed(run, x[:m]) for _ in range(3))
        self.good = [m for m in buckets if good[m]]
        for a, b in zip(self.good, self.good[1:]):     # more rows never priced lower (noise)
            seconds[b] = max(seconds[a], seconds[b])
        self.plans: dict[int, tuple[int, ...]] = {}
        best: dict[int, float] = {}
        for m in buckets:                       # cheapest good calls covering m rows
            up = next((g for g in self.good if g >= m), None)
            # padding writes its zero rows first: priced like computing them again
            top = max(g for g in self.good if g <= m)      # (1 always is): whole pieces of it
            options = [((top,) * -(-m // top), seconds[top] * -(-m // top))]
            if up is not None:
                options.append(((up,), seconds[up] * (2 - m / up)))
            for g in self.good:
                rest = onednn_rows(m - g) if g < m else m
                if rest < m:
                    options.append(((g,) + self.plans[rest], seconds[g] + best[rest]))
            self.plans[m], best[m] = min(options, key=lambda o: o[1])
        self.max_rows, self.largest = buckets[-1], self.good[-1]

    def to_dict(self) -> dict:
        return {"good": self.good, "plans": {str(m): list(c) for m, c in self.plans.items()},
                "max_rows": self.max_rows, "largest": self.largest}

    @classmethod
    def from_dict(cls, data: dict, run, width: int, dtype: torch.dtype) -> "RowPlan":
        """A plan built before on this machine (`plan_key`); builds oneDNN's kernel for each of
        its good buckets, as building the plan does, so that no step builds one."""
        plan = cls.__new__(cls)
        plan.good = [int(m) for m in data["good"]]
        plan.plans = {int(m): tuple(int(c) for c in calls) for m, calls in data["plans"].items()}
        plan.max_rows, plan.largest = int(data["max_rows"]), int(data["largest"])
        if not plan.good or plan.largest not in plan.good or any(
                c not in plan.good for calls in plan.plans.values() for c in calls):
            raise ValueError("a cached row plan that calls row counts it did not find exact")
        for m in plan.good:
            run(torch.zeros(m, width, dtype=dtype))
        return plan

    def calls(self, rows: int) -> tuple[int, ...]:
        """The row counts to call at (good buckets), in order, covering `rows`."""
        if rows <= self.max_rows:                     # every step's case: one lookup
            return self.plans[onednn_rows(rows)]
        pieces = -(-(rows - self.max_rows) // self.largest)
        return (self.largest,) * pieces + self.calls(rows - pieces * self.largest)


def prepare(weight: torch.Tensor, kernel: str) -> torch.Tensor:
    """[out, in] weight -> the layout `kernel` reads."""
    if kernel == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    if kernel == "mkl":
        return weight.t().contiguous()
    return weight


@lru_cache(maxsize=1)
def _machine() -> str:
    """What oneDNN's choice of kernel can depend on besides the call: the CPU (its model and
    instruction-set flags), torch and its oneDNN build."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read().split("\n\n")[0]
        cpu = "|".join(line for line in info.splitlines()
                       if line.startswith(("model name", "flags", "vendor_id", "cpu family")))
    except OSError:
        import platform
        cpu = platform.processor() + platform.machine()
    return f"{cpu}|{torch.__version__}|{torch.__config__.show()}"


def plan_dir(setting: str | None) -> Path | None:
    """Where row plans are kept: `setting` (EngineConfig.row_plan_dir), by default
    ~/.cache/specserve/rowplans; "" keeps none."""
    if setting == "":
        return None
    return Path(setting) if setting else Path.home() / ".cache" / "specserve" / "rowplans"


def plan_key(shape: tuple, bias: bool, dtype: torch.dtype, max_rows: int) -> str:
    """A row plan's cache key: everything its exactness and its kernels depend on (this
    machine, torch's threads, the projection's shape and dtype, the rows it covers)."""
    parts = [_machine(), str(torch.get_num_threads()), str(tuple(shape)), str(bias), str(dtype),
             str(max_rows), str(EXACT_ROWS), str(ALONE_ROWS), str(PLAN_FORMAT)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


class Linear:
    """Runs projections with one kernel for a device and dtype: "onednn" (row plans), "mkl"
    ([in, out] weights, x @ W) or "torch" (`F.linear`, every GPU).

    Row plans are kept on disk (`plan_dir`), one file per `plan_key`: building them tries every
    bucket for exact rows and times it (seconds a model), loading one builds only the kernels
    of its good buckets. A plan file from another machine, torch or thread count has another
    key, so it is never read (docs/decisions/0005-onednn-row-plans.md)."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.kernel = cpu_kernel(dtype) if device.type == "cpu" else "torch"
        self.dtype = dtype
        self.plan_dir: Path | None = None       # where row plans are cached; None: not cached
        # oneDNN: per projection shape, the calls that keep every row bit-exact (`RowPlan`),
        # and each weight's plan by identity (the step's lookup; a shape's layers share one)
        self.row_plans: dict[tuple, RowPlan] = {}
        self._plan_of: dict[int, RowPlan] = {}
        self._pending: list[tuple] = []          # prepared weights whose plans are not built

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                max_rows: int = PROBE_ROWS) -> torch.Tensor:
        """[out, in] weight -> the layout the kernel reads. Its row plan (oneDNN) is built by
        `build_plans`, once every weight is loaded."""
        weight = prepare(weight, self.kernel)
        if self.kernel == "onednn":
            self._pending.append((weight, bias, max_rows))
        return weight

    def build_plans(self) -> None:
        """Build the row plan of every prepared weight's shape (and with it oneDNN's kernels
        for every bucket), so that no step builds one."""
        pending, self._pending = self._pending, []
        for weight, bias, max_rows in pending:
            self._plan_for(weight, bias, max_rows)

    def _plan_for(self, weight: torch.Tensor, bias: torch.Tensor | None,
                  max_rows: int = PROBE_ROWS) -> RowPlan:
        key = (tuple(weight.shape), bias is None)    # [out, in], reordered too
        if key not in self.row_plans:
            with torch.inference_mode():
                self.row_plans[key] = self._cached_plan(
                    lambda x, w=weight, b=bias: self._onednn(x, w, b, x.shape[0]),
                    tuple(weight.shape), bias is not None, max_rows)
        self._plan_of[id(weight)] = self.row_plans[key]
        return self.row_plans[key]

    def _cached_plan(self, run, shape: tuple, bias: bool, max_rows: int) -> RowPlan:
        """The plan from `plan_dir` if one was built for this key, else built (and kept)."""
        path = None
        if self.plan_dir is not None:
            path = Path(self.plan_dir) / f"{plan_key(shape, bias, self.dtype, max_rows)}.json"
            try:
                data = json.loads(path.read_text())
                return RowPlan.from_dict(data, run, shape[1], self.dtype)
            except (OSError, ValueError, KeyError, TypeError):
                pass                               # none yet, or unreadable: build it
        plan = RowPlan(run, shape[1], self.dtype, max_rows)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(plan.to_dict()))
                tmp.replace(path)                  # atomic: a reader sees a whole file or none
            except OSError:
                pass
        return plan

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernel == "onednn":
            plan = self._plan_of.get(id(weight))
            if plan is None:            # not built at start (`build_plans`): build it now
                self.build_plans()
                plan = self._plan_of.get(id(weight)) or self._plan_for(weight, bias)
            calls = plan.calls(x.shape[0])
            if len(calls) == 1:
                return self._onednn(x, weight, bias, calls[0])
            outs, start = [], 0
            for m in calls:
                outs.append(self._onednn(x[start:start + m], weight, bias, m))
                start += m
            return torch.cat(outs)[:x.shape[0]]
        if self.kernel == "mkl":
            return torch.addmm(bias, x, weight) if bias is not None else x @ weight
        return F.linear(x, weight, bias)

    @staticmethod
    def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                padded: int) -> torch.Tensor:
        """One oneDNN call at `padded` rows (x's, then zero rows, dropped from the output)."""
        rows = x.shape[0]
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out[:rows] if padded != rows else out
