"""Fresh rows for on-policy distillation steps, and the target's continuations through the engine.

Owns: which training rows a step reads (`step_rows`), the pool of freshly written rows
(`Rollouts`: the student's own continuations, or the target's with the logits it sampled them
from), and `TargetWriter`, the target's continuations of many prompts through specserve's own
engine (baseline mode, batched, seeded per row): the teacher's cached continuations and the
target-written rollouts (docs/decisions/0035-sampled-objective.md) come from it.
"""

from __future__ import annotations

import itertools
import time

import torch

from models.distill import DistillData, student_rollouts


def step_rows(data: DistillData, n: int, seed: int, step: int) -> torch.Tensor:
    """`n` row indices for global step `step`, chosen from (seed, step) alone, so a resumed run
    draws what an uninterrupted one would have."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(len(data.classes), (n,), generator=g)


def trimmed(data: DistillData) -> DistillData:
    """`data` without the padding columns its longest row does not need."""
    width = int(data.lengths.max())
    return DistillData(data.tokens[:, :width], data.lengths, data.prompt_lens, data.classes)


class TargetWriter:
    """The target's continuations through the engine: one `LLMEngine` (baseline mode, `threads`
    torch threads, `max_num_seqs` in a batch) kept for every call, each row sampled with its own
    seed, so a call's rows depend on its seeds alone. It writes rows at the speed the target is
    served, faster than `transformers`' `generate` (docs/decisions/0035-sampled-objective.md)."""

    def __init__(self, target: str, threads: int, max_num_seqs: int = 64, seed: int = 0):
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine

        self.engine = LLMEngine(EngineConfig(target=str(target), profile=False, num_threads=threads,
                                             max_num_seqs=max_num_seqs, max_waiting=1 << 20, seed=seed))
        self.ids = itertools.count()

    def continuations(self, prompts: list[list[int]], new_tokens: int, temperature: float,
                      seeds: list[int], progress: str | None = None) -> list[list[int]]:
        """Each prompt's continuation (`new_tokens` at most; it ends after the target's end of
        sequence), sampled at `temperature` with its row's seed; `progress` names a bar."""
        return self._write(prompts, new_tokens, temperature, seeds, progress, False)[0]

    def continuations_with_logits(self, prompts: list[list[int]], new_tokens: int,
                                  temperature: float, seeds: list[int]):
        """`continuations`, and per row the target's logits each token was sampled from (one
        [len(continuation), vocab] bfloat16 tensor), from the forwards that wrote them."""
        return self._write(prompts, new_tokens, temperature, seeds, None, True)

    def _write(self, prompts, new_tokens, temperature, seeds, progress, keep_logits):
        from engine.sampling_params import Mode, RequestOptions, SamplingParams

        names = []
        options = RequestOptions(mode=Mode.BASELINE, keep_logits=keep_logits, detokenize=False)
        for ids, seed in zip(prompts, seeds, strict=True):
            names.append(f"w{next(self.ids)}")
            params = SamplingParams(temperature=temperature, max_tokens=new_tokens, seed=seed)
            self.engine.add_request(names[-1], ids, params, options)
        outs: dict[str, list[int]] = {name: [] for name in names}
        rows: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), unit="prompt", desc=progress)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                outs[out.request_id] += out.token_ids
                if out.logits is not None:
                    rows[out.request_id].append(out.logits)
                if bar is not None:
                    bar.update(int(out.finished))
        if bar is not None:
            bar.close()
        logits = [torch.cat(rows[name]) for name in names] if keep_logits else None
        return [outs[name] for name in names], logits


def generate(target: str, prompts: list[list[int]], new_tokens: int, temperature: float,
             seed: int, threads: int, log=print, max_num_seqs: int = 32) -> list[list[int]]:
    """The target's continuation of every prompt (`TargetWriter`, row i seeded from `seed`)."""
    start = time.monotonic()
    writer = TargetWriter(target, threads, max_num_seqs, seed)
    conts = writer.continuations(prompts, new_tokens, temperature,
                                 [seed * 100_003 + i for i in range(len(prompts))],
                                 progress="target continuations")
    n = sum(map(len, conts))
    log(f"target generated {n} tokens for {len(prompts)} prompts in {time.monotonic() - start:.0f} s")
    return conts


class Rollouts:
    """On-policy rows: `_batch`'s kind of rows (models/distill_train.py) whose continuations are
    written fresh, as long as the target's, `steps_per_draw` steps' worth at a time. The student
    being trained writes them (`student_rollouts`; one generation of a larger batch costs about
    what one of a step's batch does, and a draw's rows are at most that many steps behind the
    student), and the teacher scores them in the step. Or a `TargetWriter` does (fresh samples
    of the distribution served contexts follow; the target does not change, so its draws may be
    larger), and the logits it sampled each token from are the teacher's distribution there
    (at `t_loss`): no teacher forward in the step, and the loss covers the continuation, where
    a draft drafts. A resumed run samples its rows afresh."""

    def __init__(self, data: DistillData, size: int, seed: int, temperature: float,
                 eos_ids: tuple[int, ...] = (), steps_per_draw: int = 4, writer=None,
                 t_loss: float = 1.0):
        self.data, self.size, self.seed, self.temperature = data, size, seed, temperature
        self.eos_ids, self.writer, self.t_loss = eos_ids, writer, t_loss
        self.steps_per_draw = steps_per_draw
        self.new_tokens = int((data.lengths - data.prompt_lens).max())
        self.pool: list[tuple[DistillData, list[torch.Tensor] | None]] = []

    def batch(self, engine, step: int):
        """The rows of `step` as `_batch` gives them: the student's own continuations (the
        teacher left to the step), or the writer's with the teacher's log-probs."""
        if not self.pool:
            self._draw(engine.module, step)
        sub, logits = self.pool.pop()
        if logits is None:
            return sub.tokens[:, :-1], sub.tokens[:, 1:], sub.loss_mask(), None, None
        mask = sub.loss_mask(completion_only=True)
        teacher = torch.zeros(*mask.shape, logits[0].shape[-1])
        for r, rows in enumerate(logits):     # position t scores token t + 1
            p = int(sub.prompt_lens[r])
            teacher[r, p - 1:p - 1 + len(rows)] = torch.log_softmax(rows.float() / self.t_loss, -1)
        return sub.tokens[:, :-1], sub.tokens[:, 1:], mask, teacher, None

    def _draw(self, module, step: int) -> None:
        n = self.size * self.steps_per_draw
        rows = step_rows(self.data, n, self.seed, step).tolist()
        sub = self.data.subset(rows)
        logits = None
        if self.writer is None:
            torch.manual_seed(self.seed * 1_000_003 + step)       # the sampling, too
            drawn = student_rollouts(module, sub, self.new_tokens, self.temperature, self.eos_ids)
        else:
            prompts = [sub.tokens[r, :int(p)].tolist() for r, p in enumerate(sub.prompt_lens)]
            seeds = [(self.seed * 1_000_003 + step) * 1_009 + r for r in range(n)]
            conts, logits = self.writer.continuations_with_logits(prompts, self.new_tokens,
                                                                  self.temperature, seeds)
            drawn = DistillData.from_rows(list(zip(prompts, conts, sub.classes)))
        for s in range(n - self.size, -1, -self.size):             # popped in draw order
            part = list(range(s, s + self.size))
            self.pool.append((trimmed(drawn.subset(part)),
                              None if logits is None else [logits[i] for i in part]))
