"""Measuring the step-cost model at engine start, cached per model pair and device.

Owns: timing a few target and draft forwards over batches of different sizes and query lengths,
keeping them as an interpolated table (`engine.step_cost.TableStepCost`), cached as JSON (a second start
with the same models, dtype, device and threads reads it back at once). A few seconds on CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from engine.attention import SeqSlice
from engine.calibration import step_cost_from_dict
from engine.kv_rules import blocks_needed
from engine.step_cost import LinearCost, LinearStepCost, TableCost, TableStepCost

# Cached tokens per sequence while timing: the middle of the contexts served in the benchmarks
# (128-token prompts, up to 128 new). Attention's cost grows with context, and a verify row
# costs more than a decode row there; a table timed at a short context under-prices both, and
# adaptive k over-drafts at large batches.
CONTEXT = 192
VERSION = 16                      # bump when the forward's speed changes (kernels, layout, the
#                                   way the grid is timed): cached tables then re-measure
SEQS = (1, 2, 4, 8, 16, 32)                     # batch sizes timed
TOKENS_PER_SEQ = (1, 2, 3, 5, 8)                 # query tokens per sequence (1 + k)
GRID = [(n, q) for n in SEQS for q in TOKENS_PER_SEQ]
REPEATS = 5                       # timed runs per point (median), after WARMUP untimed
WARMUP = 2                        # (after one, the first point timed can still read ~2x its
                                  # cost, and adaptive k misjudges batch 1)


def _key(engine) -> str:
    c = engine.config
    parts = [str(Path(c.target).resolve()), str(c.draft and Path(c.draft).resolve()),
             str(engine.target_fw.dtype),
             c.device, str(c.num_threads), str(c.tp_size), torch.__version__, platform.processor(),
             str(os.cpu_count()), engine.target_fw.kernel, c.attention, str(VERSION)]
    for folder in filter(None, [c.target, c.draft]):
        for f in sorted(Path(folder).glob("*.safetensors")):
            parts.append(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _cache_dir(engine) -> Path:
    return Path(engine.config.cost_cache_dir or Path.home() / ".cache" / "specserve" / "costs")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _fill(runner, tables: list[list[int]], max_tokens: int) -> None:
    """Write CONTEXT tokens of KV into each table, in forwards of at most `max_tokens` tokens
    (the step's token budget: the memory plan measured activations up to it)."""
    step = max(1, min(CONTEXT, max_tokens))
    pieces = [SeqSlice(t, start, min(step, CONTEXT - start))
              for t in tables for start in range(0, CONTEXT, step)]
    batch: list[SeqSlice] = []
    for piece in pieces + [None]:
        if piece is None or (batch and sum(s.num_query for s in batch) + piece.num_query
                             > max_tokens):
            ids = [1] * sum(s.num_query for s in batch)
            pos = [s.num_cached + i for s in batch for i in range(s.num_query)]
            runner.run(batch, ids, pos, [0])
            batch = []
        if piece is not None:
            batch.append(piece)


def _time_runner(runner, pool, owner: str, tpb: int, grid,
                 max_tokens: int = 512) -> list[tuple[int, int, int, float]]:
    """Time `runner` over scratch sequences; every block is returned to the pool afterwards.

    The grid is timed in passes, every point once a pass (WARMUP untimed passes, then REPEATS
    timed ones), and each point keeps its median: a slow spell of a shared machine then
    touches every point alike instead of the few timed during it, and one start's table prices
    drafting as the next one's does (docs/decisions/0010-cost-calibration.md). The medians are
    then made monotone (`_monotone`)."""
    samples = []
    max_seqs = max(n for n, _ in grid)
    per_seq = blocks_needed(CONTEXT + max(q for _, q in grid), tpb)
    if per_seq * max_seqs > pool.num_free:
        max_seqs = pool.num_free // per_seq
        grid = [(n, q) for n, q in grid if n <= max_seqs]
    tables = [pool.allocate(per_seq, owner) for _ in range(max_seqs)]
    try:
        _fill(runner, tables, max_tokens)
        times: dict[tuple[int, int], list[float]] = {point: [] for point in grid}
        for _ in range(WARMUP + REPEATS):
            for n, q in grid:
                seqs = [SeqSlice(t, CONTEXT, q) for t in tables[:n]]
                ids, pos = [1] * (n * q), list(range(CONTEXT, CONTEXT + q)) * n
                _sync(runner.device)
                start = time.perf_counter()
                runner.run(seqs, ids, pos, list(range(n * q)))
                _sync(runner.device)
                times[(n, q)].append(time.perf_counter() - start)
        medians = _monotone({point: statistics.median(t[WARMUP:]) for point, t in times.items()})
        samples = [(n, n * q, 0, medians[(n, q)]) for n, q in grid]      # context held fixed
    finally:
        for t in tables:
            pool.free(t, owner)
    return samples


def _monotone(medians: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """The timed medians made non-decreasing in query tokens at each batch size, then in batch
    size at each tokens-per-sequence, by isotonic regression (pool adjacent violators): more
    work never prices lower. A point that read slow and its lower neighbour are replaced by
    their mean, so a noisy point no longer makes one extra token free (or dear)."""
    out = dict(medians)
    lines = [sorted((p for p in out if p[outer] == key), key=lambda p: p[inner])
             for outer, inner in ((0, 1), (1, 0)) for key in sorted({p[outer] for p in out})]
    for _ in range(100):     # each direction's fit can undo a little of the other's: alternate
        for line in lines:   # until both hold (a few rounds on a profile's grid)
            for p, v in zip(line, _isotonic([out[p] for p in line])):
                out[p] = v
        if all(out[a] <= out[b] * (1 + 1e-9) for line in lines for a, b in zip(line, line[1:])):
            break
    return out


def _isotonic(values: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []                    # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, c2 = blocks.pop()
            m1, c1 = blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


def profile(engine) -> tuple[TableStepCost, dict]:
    grid = [(n, q) for n, q in GRID if n <= engine.config.max_num_seqs]
    pool, budget = engine.pool, engine.config.max_num_batched_tokens
    target = _time_runner(engine.target, pool, "target", pool.target.tokens_per_block, grid,
                          budget)
    if not target:                     # a pool too small to time even one sequence
        return default_cost(engine), {}
    draft = []
    if engine.draft is not None:
        draft = _time_runner(engine.draft, pool, "draft", pool.draft.tokens_per_block,
                             [(n, q) for n in sorted({n for n, _ in grid}) for q in (1, 2)],
                             budget)
    cost = TableStepCost(TableCost.measure_grid(target),
                         TableCost.measure_grid(draft) if draft else None)
    return cost, {"target_samples": target, "draft_samples": draft}


def default_cost(engine) -> LinearStepCost:
    """Without profiling: per-step overhead dominates, the draft costs its share of parameters."""
    ratio = engine.draft_model.num_params / engine.target_model.num_params if engine.draft_model else 0
    target = LinearCost(fixed_s=1e-2, per_seq_s=2e-4, per_token_s=5e-4)
    return LinearStepCost(target, LinearCost(1e-2 * ratio, 2e-4 * ratio, 5e-4 * ratio))


def load_or_profile(engine):
    if not engine.config.profile:
        return default_cost(engine)
    path = _cache_dir(engine) / f"{_key(engine)}.json"
    if path.exists():
        try:
            return step_cost_from_dict(json.loads(path.read_text())["cost"])
        except (KeyError, ValueError, TypeError):
            pass
    cost, samples = profile(engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"cost": cost.to_dict(), **samples}, indent=1))
    tmp.replace(path)
    return cost
