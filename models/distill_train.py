"""The distillation run: held-out acceptance before, DeepSpeed training, acceptance after, report.

Owns: one resumable run over prepared `DistillData` (see `models/distill.py`): the teacher cache,
the train/held-out split, the DeepSpeed step loop under a step or time budget with a progress bar,
DeepSpeed checkpoints (resumed from `OUT/checkpoints`), the output folder and its `distill.json`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from models.distill import (DIVERGENCES, DistillData, default_ds_config, default_objective, distill_loss,
                            init_deepspeed, loss_temperature, save_hf, served_acceptance, split_heldout,
                            teacher_topk, write_report)
from models.distill_best import Best
from models.distill_rollouts import Rollouts, TargetWriter, step_rows
from models.loader import check_compatible, eos_token_ids, load_model

KEEP_CHECKPOINTS = 2
TARGET_STEPS_PER_DRAW = 16      # the target does not change while the student trains: draw more


def _batch(data: DistillData, values, ids, size: int, seed: int, step: int):
    """The batch of global step `step` (its rows from `step_rows`)."""
    rows = step_rows(data, size, seed, step)
    sub = data.subset(rows.tolist())
    length = int(sub.lengths.max())
    tokens = sub.tokens[:, :length]
    if values is None:
        return tokens[:, :-1], tokens[:, 1:], sub.loss_mask()[:, :length - 1], None, None
    return (tokens[:, :-1], tokens[:, 1:], sub.loss_mask()[:, :length - 1],
            values[rows, :length - 1], ids[rows, :length - 1])


def _on_policy_step(seed: int, step: int, share: float) -> bool:
    """Whether global step `step` trains on the student's own continuations (a `share` of steps,
    chosen from (seed, step) alone)."""
    g = torch.Generator().manual_seed(seed * 7_919 + step)
    return share > 0 and float(torch.rand(1, generator=g)) < share


def _prune(ckpt: Path) -> None:
    tags = sorted((d for d in ckpt.iterdir() if d.is_dir() and d.name.startswith("step")),
                  key=lambda d: int(d.name[4:]))
    for old in tags[:-KEEP_CHECKPOINTS]:
        for f in sorted(old.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        old.rmdir()


def run_distill(target_path: str | Path, student_path: str | Path, data: DistillData, out: str | Path,
                temperature: float | list[float] = 1.0, steps: int | None = None, minutes: float | None = None,
                ds_config: dict | None = None, heldout: float = 0.15, seed: int = 0,
                role: str = "draft", top_k: int = 64, checkpoint_every_s: float = 120.0,
                validation: float = 0.05, eval_every_s: float = 60.0,
                guard_data: DistillData | None = None, divergence: str | None = None,
                on_policy: float | None = None, drops: dict[str, float] | None = None,
                anneal: float | None = None, rollouts: str | None = None, log=print) -> dict:
    """Train the student in `student_path` towards the target on `data`; write `out`.

    `steps` counts DeepSpeed optimizer steps in total (a resumed run continues to it);
    `minutes` bounds the training time, previous attempts included. Every `eval_every_s` the
    student is scored on a validation share of the training prompts (`validation`; never the
    held-out ones) at the served temperature, and the best-scoring weights whose classes each
    stay within the swap guard's drop are what `out` gets (`models/distill_best.py`; early
    stopping: a small draft memorises a few hundred prompts' continuations and gets worse on
    new prompts, docs/decisions/0020-aligned-drafts.md). With several served
    temperatures (a list) `data`'s rows are labelled `class@T..` (`models.distill.at_temperature`)
    and each is scored at its own. `guard_data` (other traffic the draft serves, never trained
    on) is scored before and after as well, for the swap's guard. `divergence` is the loss
    (`models.distill.distill_loss`); `on_policy` is the share of steps on fresh continuations
    at the (highest) served temperature; `rollouts` says who writes them (the student, or the
    target through the engine with its logits as the teacher's, `Rollouts`); `anneal`: the last share
    of the budget takes the learning rate linearly to 0; each left None takes
    `models.distill.default_objective`'s. `drops` allows a class (e.g. `replay`) a larger drop
    than the swap guard's MAX_DROP, in the kept step's choice and in the guard that reads the
    report. Returns the report.
    """
    temps = [temperature] if isinstance(temperature, (int, float)) else list(temperature)
    objective = _Objective.of(divergence, on_policy, temps, rollouts, anneal)
    if not steps and not minutes:
        raise ValueError("give a budget: steps or minutes")
    out = Path(out)
    ckpt = out / "checkpoints"
    ckpt.mkdir(parents=True, exist_ok=True)
    target = load_model(target_path)
    student = load_model(student_path)
    check_compatible(target, student, role)        # vocabulary size and every token's id
    objective.rollout_eos = eos_token_ids(student.path, student.config)
    split = _Split.of(data, heldout, validation, seed)
    t_loss = objective.t_loss
    top_k = top_k if objective.on_policy < 1 else 0      # every step on-policy: no cache is read
    teacher = _Teacher.of(out / "teacher.pt", target, split.train, t_loss, top_k)
    log(f"teacher top-{top_k or 'all'}: {teacher.mass:.3f} of the probability mass, {teacher.seconds:.0f} s")
    before, guard_before = _scored_before(out, target.model, student.model, split.held, guard_data,
                                          temps, log)

    config = ds_config or default_ds_config()
    model = student.model.float().train()
    best = Best(out / "best.pt", target.model, split.val, temps, drops or {})
    if best.step is None:            # the student as given (before DeepSpeed casts it): kept if
        best.offer(0, model)         # no training step beats it
    engine, optimizer, _ = init_deepspeed(model, config)
    budget = _Budget(steps, minutes * 60 if minutes else None, checkpoint_every_s, eval_every_s,
                     objective.anneal)
    trained_s, recent = _train(engine, ckpt, target.model, split.train, teacher, objective, best,
                               budget, seed, role, log, objective.writer(target.path, seed))
    best.offer(engine.global_steps, engine.module)
    after, guard = _keep(best, engine, student_path, target, out, split.held, guard_data,
                         guard_before, temps, log)
    report = {"role": role, "target": str(target.path), "student": str(student.path),
              "temperature": temps[0] if len(temps) == 1 else temps, "loss_temperature": t_loss,
              "objective": {"divergence": objective.divergence, "on_policy": objective.on_policy,
                            "rollouts": objective.rollouts},
              "trainer": "deepspeed", "deepspeed": _deepspeed_record(engine, optimizer, config),
              "data": {"train_rows": len(split.train_idx), "heldout_rows": len(split.held_idx),
                       "train_tokens": int(split.train.loss_mask().sum()),
                       "classes": sorted(set(data.classes)), "teacher_top_k": top_k,
                       "teacher_mass": round(teacher.mass, 4), "teacher_s": round(teacher.seconds, 1)},
              "train": {"seconds": round(trained_s, 1),
                        "final_divergence": round(sum(recent) / max(1, len(recent)), 4)
                        if recent else None,
                        "kept_step": best.step, "validation_rows": len(split.val_idx),
                        "anneal": objective.anneal,
                        "last_lr": [g["lr"] for g in engine.optimizer.param_groups][0],
                        "validation": best.history},
              "heldout": {"before": before, "after": after, "delta": _delta(before, after)},
              "guard": guard, "drops": drops or {}}
    write_report(out, report)
    return report


def _keep(best: Best, engine, student_path, target, out: Path, held: DistillData,
          guard_data: DistillData | None, guard_before: dict | None, temps: list[float],
          log) -> tuple[dict, dict | None]:
    """The kept weights written to `out` as the student's checkpoint, reloaded and scored on
    the held-out rows and the guard set: (held-out after, the guard's before/after/delta)."""
    kept = load_model(student_path).model.float()
    kept.load_state_dict(best.state() or engine.module.state_dict())
    log(f"kept the weights of step {best.step} (validation acceptance {best.score:.4f})")
    save_hf(kept, Path(target.path), out)
    reloaded = load_model(out).model
    after = served_acceptance(target.model, reloaded, held, temps)
    log("held-out after:  " + _fmt(after))
    if guard_data is None:
        return after, None
    guard_after = served_acceptance(target.model, reloaded, guard_data, temps)
    log("guard set after:  " + _fmt(guard_after))
    return after, {"before": guard_before, "after": guard_after,
                   "delta": _delta(guard_before, guard_after)}


@dataclass
class _Split:
    """The rows of a run: held out (never trained on), validation (scored while training, for
    early stopping) and the rest, trained on."""

    train: DistillData
    held: DistillData
    val: DistillData
    train_idx: list[int]      # rows of the data not held out (validation included)
    held_idx: list[int]
    val_idx: list[int]        # rows of train_idx that validate

    @classmethod
    def of(cls, data: DistillData, heldout: float, validation: float, seed: int) -> "_Split":
        train_idx, held_idx = split_heldout(data.classes, heldout, seed, data.prompt_groups())
        held_data = data.subset(held_idx)
        train_data = data.subset(train_idx)
        fit, val = split_heldout(train_data.classes, validation, seed + 1, train_data.prompt_groups())
        if not validation or not fit:
            fit, val = list(range(len(train_idx))), []
        return cls(train_data.subset(fit), held_data, train_data.subset(val), train_idx, held_idx, val)


@dataclass
class _Teacher:
    """The target's top-k log-probabilities over the training rows (None with top_k 0: the
    teacher then runs beside the student, every step), their share of the probability mass and
    the seconds they took; cached in `cache` for a resumed run."""

    values: torch.Tensor | None
    ids: torch.Tensor | None
    mass: float
    seconds: float

    @classmethod
    def of(cls, cache: Path, target, train: DistillData, t_loss: float, top_k: int) -> "_Teacher":
        t0 = time.monotonic()
        if not top_k:
            values = ids = None
            mass = 1.0
        elif cache.exists():
            values, ids, mass = torch.load(cache).values()
        else:
            values, ids, mass = teacher_topk(target.model, train, t_loss, min(top_k, target.vocab_size))
            torch.save({"values": values, "ids": ids, "mass": mass}, cache)
        return cls(values, ids, mass, time.monotonic() - t0)


@dataclass
class _Objective:
    """What a step minimises: the divergence at the loss temperature, and the share of steps on
    fresh continuations (sampled at `rollout_temperature`) written by `rollouts`: the student
    itself, or the target; and the budget's last share that anneals the learning rate."""

    divergence: str
    t_loss: float
    on_policy: float
    rollout_temperature: float
    rollouts: str = "student"
    anneal: float = 0.0
    rollout_eos: tuple[int, ...] = ()

    @classmethod
    def of(cls, divergence: str | None, on_policy: float | None, temps: list[float],
           rollouts: str | None = None, anneal: float | None = None) -> "_Objective":
        """The given choices, `default_objective`'s where None, for the served `temps`; refused
        before any model loads when out of range."""
        chosen = default_objective(temps)
        divergence = divergence or chosen.divergence
        on_policy = chosen.on_policy if on_policy is None else on_policy
        rollouts = rollouts or chosen.rollouts
        anneal = chosen.anneal if anneal is None else anneal
        if divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
        if not 0 <= on_policy <= 1:
            raise ValueError(f"on_policy is a share of steps in [0, 1], got {on_policy}")
        if rollouts not in ("student", "target"):
            raise ValueError(f"rollouts are written by the student or the target, got {rollouts!r}")
        if not 0 <= anneal <= 1:
            raise ValueError(f"anneal is a share of the budget in [0, 1], got {anneal}")
        return cls(divergence, loss_temperature(temps), on_policy, max(temps), rollouts, anneal)

    def writer(self, target_path, seed: int) -> TargetWriter | None:
        """The engine that writes the fresh rows where the target does, else None."""
        if self.rollouts != "target" or self.on_policy <= 0:
            return None
        return TargetWriter(target_path, torch.get_num_threads(), seed=seed)


@dataclass
class _Budget:
    """How long a run trains, and how often it checkpoints and scores the student."""

    steps: int | None             # DeepSpeed optimizer steps in all, or None
    seconds: float | None         # training time in all, or None
    checkpoint_every_s: float
    eval_every_s: float
    anneal: float = 0.0           # the last share of the budget takes the learning rate to 0

    def lr_scale(self, step: int, seconds: float) -> float:
        """The learning rate's factor at this point of the budget: 1, then linearly down to 0
        over its last `anneal` share (the steps' share with a step budget, else the time's)."""
        done = step / self.steps if self.steps else seconds / self.seconds
        if self.anneal <= 0 or done <= 1 - self.anneal:
            return 1.0
        return max(0.0, (1 - done) / self.anneal)


def _scored_before(out: Path, target, student, held: DistillData, guard: DistillData | None,
                   temps: list[float], log) -> tuple[dict, dict | None]:
    """The student as given, scored on the held-out rows and the guard set (None without one),
    each once per run (a resumed run reads them back)."""
    before, _ = _measured_once(out / "before.json", lambda: served_acceptance(target, student, held, temps))
    log("held-out before: " + _fmt(before))
    if guard is None:
        return before, None
    guard_before, fresh = _measured_once(out / "guard_before.json",
                                         lambda: served_acceptance(target, student, guard, temps))
    if fresh:
        log("guard set before: " + _fmt(guard_before))
    return before, guard_before


def _measured_once(path: Path, measure) -> tuple[dict, bool]:
    """(measure()'s result, True), written to `path`; or what `path` holds (a resumed run), False."""
    if path.exists():
        return json.loads(path.read_text()), False
    result = measure()
    path.write_text(json.dumps(result))
    return result, True


def _train(engine, ckpt: Path, target, train: DistillData, teacher: _Teacher, objective: _Objective,
           best: "Best", budget: _Budget, seed: int, role: str, log,
           writer: TargetWriter | None = None) -> tuple[float, list[float]]:
    """DeepSpeed steps from the last checkpoint in `ckpt` until the budget is spent, offering the
    student to `best` every eval_every_s and checkpointing every checkpoint_every_s and at the
    end: (seconds trained, previous attempts included; the last steps' divergence). `writer`
    writes the on-policy rows where the target does (`--rollouts target`)."""
    from tqdm.auto import tqdm

    elapsed = 0.0
    if any(ckpt.glob("step*")):
        path, state = engine.load_checkpoint(str(ckpt))
        elapsed = float((state or {}).get("elapsed_s", 0.0))
        log(f"resumed {path} at step {engine.global_steps} ({elapsed:.0f} s trained)")
    steps, budget_s = budget.steps, budget.seconds
    size = engine.train_micro_batch_size_per_gpu()
    seed_r = seed + 7919 * engine.global_rank
    rollouts = Rollouts(train, size, seed_r, objective.rollout_temperature, objective.rollout_eos,
                        TARGET_STEPS_PER_DRAW if writer else 4, writer, objective.t_loss)
    bar = (tqdm(total=steps, initial=engine.global_steps, unit="step", desc=f"distil {role}")
           if steps else tqdm(total=round(budget_s), initial=round(elapsed), unit="s", desc=f"distil {role}"))
    start, last_ckpt, recent = time.monotonic() - elapsed, time.monotonic(), []
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else None
    last_eval = time.monotonic()
    peaks = list(getattr(engine.lr_scheduler, "max_lrs", None)      # the warm-up's peak
                 or [g["lr"] for g in engine.optimizer.param_groups])
    while True:
        done = time.monotonic() - start
        if (steps and engine.global_steps >= steps) or (budget_s and done >= budget_s):
            break
        if time.monotonic() - last_eval >= budget.eval_every_s:
            best.offer(engine.global_steps, engine.module)
            last_eval = time.monotonic()
        step = engine.global_steps
        if _on_policy_step(seed_r, step, objective.on_policy):
            batch = rollouts.batch(engine, step)
        else:
            batch = _batch(train, teacher.values, teacher.ids, size, seed_r, step)
        recent = (recent + [_step(engine, target, batch, objective, dtype)])[-20:]
        if budget.anneal > 0:         # after the scheduler's step: the lr of the next one
            scale = budget.lr_scale(engine.global_steps, time.monotonic() - start)
            for group, peak in zip(engine.optimizer.param_groups, peaks):
                group["lr"] = peak * scale
        bar.set_postfix(step=step, **{objective.divergence: f"{sum(recent) / len(recent):.3f}"},
                        best=f"{best.score:.3f}@{best.step}", refresh=False)
        bar.update(1) if steps else bar.update(round(time.monotonic() - start) - bar.n)
        if time.monotonic() - last_ckpt >= budget.checkpoint_every_s:
            _checkpoint(engine, ckpt, time.monotonic() - start)
            last_ckpt = time.monotonic()
    bar.close()
    trained_s = time.monotonic() - start
    _checkpoint(engine, ckpt, trained_s)
    return trained_s, recent


def _step(engine, target, batch, objective: _Objective, dtype) -> float:
    """One DeepSpeed optimizer step on `batch` (`_batch`); its divergence from the teacher."""
    inputs, labels, mask, v, i = batch
    t_loss = objective.t_loss
    if v is None:             # the teacher in the step, in the training's dtype (cheaper in bf16)
        with torch.no_grad(), torch.autocast(inputs.device.type, dtype=dtype, enabled=dtype is not None):
            v = torch.log_softmax(target(input_ids=inputs).logits.float() / t_loss, -1)
    logits = engine(input_ids=inputs).logits
    loss, kl = distill_loss(logits, v, i, labels, mask, t_loss, divergence=objective.divergence)
    engine.backward(loss.to(dtype) if dtype else loss)
    before_step = engine.global_steps
    engine.step()
    if engine.global_steps == before_step and not engine.skipped_steps:
        raise RuntimeError("DeepSpeed's engine did not advance its step count")
    return kl


def _checkpoint(engine, ckpt: Path, elapsed_s: float) -> None:
    """A DeepSpeed checkpoint of this step, the oldest beyond KEEP_CHECKPOINTS removed."""
    engine.save_checkpoint(str(ckpt), tag=f"step{engine.global_steps}",
                           client_state={"elapsed_s": elapsed_s})
    _prune(ckpt)


def _deepspeed_record(engine, optimizer, config: dict) -> dict:
    return {"global_steps": engine.global_steps, "optimizer": type(optimizer).__name__,
            "inner_optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
            "zero_stage": engine.zero_optimization_stage(),
            "bf16": engine.bfloat16_enabled(), "config": config}


def _delta(before: dict, after: dict) -> dict:
    return {c: round(after[c]["acceptance"] - before[c]["acceptance"], 4) for c in after if c in before}


def _fmt(acc: dict) -> str:
    return "  ".join(f"{c}: acc {v['acceptance']:.3f} greedy {v['greedy']:.3f}" for c, v in acc.items())
