"""The distillation run: held-out acceptance before, DeepSpeed training, acceptance after, report.

Owns: one resumable run over prepared `DistillData` (see `models/distill.py`): the teacher cache,
the train/held-out split, the DeepSpeed step loop under a step or time budget with a progress bar,
DeepSpeed checkpoints (resumed from `OUT/checkpoints`), the output folder and its `distill.json`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from models.distill import (DistillData, default_ds_config, distill_loss, init_deepspeed,
                            loss_temperature, save_hf, served_acceptance, split_heldout,
                            teacher_topk, write_report)
from models.loader import check_compatible, load_model

KEEP_CHECKPOINTS = 2


def _batch(data: DistillData, values, ids, size: int, seed: int, step: int):
    """The batch of global step `step`: chosen from (seed, step) alone, so a resumed run draws
    what an uninterrupted one would have."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    rows = torch.randint(len(data.classes), (size,), generator=g)
    sub = data.subset(rows.tolist())
    length = int(sub.lengths.max())
    tokens = sub.tokens[:, :length]
    if values is None:
        return tokens[:, :-1], tokens[:, 1:], sub.loss_mask()[:, :length - 1], None, None
    return (tokens[:, :-1], tokens[:, 1:], sub.loss_mask()[:, :length - 1],
            values[rows, :length - 1], ids[rows, :length - 1])


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
                guard_data: DistillData | None = None, log=print) -> dict:
    """Train the student in `student_path` towards the target on `data`; write `out`.

    `steps` counts DeepSpeed optimizer steps in total (a resumed run continues to it);
    `minutes` bounds the training time, previous attempts included. Every `eval_every_s` the
    student is scored on a validation share of the training prompts (`validation`; never the
    held-out ones) at the served temperature, and the best-scoring weights are what `out`
    gets (early stopping: a small draft memorises a few hundred prompts' continuations and
    gets worse on new prompts, docs/decisions/0020-aligned-drafts.md). With several served
    temperatures (a list) `data`'s rows are labelled `class@T..` (`models.distill.at_temperature`)
    and each is scored at its own. `guard_data` (other traffic the draft serves, never trained on) is scored before
    and after as well, for the swap's guard. Returns the report.
    """
    from tqdm.auto import tqdm

    if not steps and not minutes:
        raise ValueError("give a budget: steps or minutes")
    out = Path(out)
    ckpt = out / "checkpoints"
    ckpt.mkdir(parents=True, exist_ok=True)
    target = load_model(target_path)
    student = load_model(student_path)
    check_compatible(target, student, role)        # vocabulary size and every token's id
    train_idx, held_idx = split_heldout(data.classes, heldout, seed, data.prompt_groups())
    held_data = data.subset(held_idx)
    train_data = data.subset(train_idx)
    fit, val = split_heldout(train_data.classes, validation, seed + 1, train_data.prompt_groups())
    if not validation or not fit:
        fit, val = list(range(len(train_idx))), []
    val_data, train_data = train_data.subset(val), train_data.subset(fit)
    temps = [temperature] if isinstance(temperature, (int, float)) else list(temperature)
    t_loss = loss_temperature(temps)

    cache = out / "teacher.pt"
    t0 = time.monotonic()
    if not top_k:                     # the teacher runs beside the student, every step
        values = ids = None
        mass = 1.0
    elif cache.exists():
        values, ids, mass = torch.load(cache).values()
    else:
        values, ids, mass = teacher_topk(target.model, train_data, t_loss, min(top_k, target.vocab_size))
        torch.save({"values": values, "ids": ids, "mass": mass}, cache)
    teacher_s = time.monotonic() - t0
    log(f"teacher top-{top_k or 'all'}: {mass:.3f} of the probability mass, {teacher_s:.0f} s")

    before_file = out / "before.json"
    if before_file.exists():
        before = json.loads(before_file.read_text())
    else:
        before = served_acceptance(target.model, student.model, held_data, temps)
        before_file.write_text(json.dumps(before))
    log("held-out before: " + _fmt(before))
    guard_file = out / "guard_before.json"
    if guard_data is not None and guard_file.exists():
        guard_before = json.loads(guard_file.read_text())
    elif guard_data is not None:
        guard_before = served_acceptance(target.model, student.model, guard_data, temps)
        guard_file.write_text(json.dumps(guard_before))
        log("guard set before: " + _fmt(guard_before))

    config = ds_config or default_ds_config()
    model = student.model.float().train()
    best = _Best(out / "best.pt", target.model, val_data, temps)
    if best.step is None:            # the student as given (before DeepSpeed casts it): kept if
        best.offer(0, model)         # no training step beats it
    engine, optimizer, _ = init_deepspeed(model, config)
    elapsed = 0.0
    if any(ckpt.glob("step*")):
        path, state = engine.load_checkpoint(str(ckpt))
        elapsed = float((state or {}).get("elapsed_s", 0.0))
        log(f"resumed {path} at step {engine.global_steps} ({elapsed:.0f} s trained)")
    size = engine.train_micro_batch_size_per_gpu()
    seed_r = seed + 7919 * engine.global_rank
    budget_s = minutes * 60 if minutes else None
    bar = (tqdm(total=steps, initial=engine.global_steps, unit="step", desc=f"distil {role}")
           if steps else tqdm(total=round(budget_s), initial=round(elapsed), unit="s", desc=f"distil {role}"))
    start, last_ckpt, recent = time.monotonic() - elapsed, time.monotonic(), []
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else None
    last_eval = time.monotonic()
    while True:
        done = time.monotonic() - start
        if (steps and engine.global_steps >= steps) or (budget_s and done >= budget_s):
            break
        if time.monotonic() - last_eval >= eval_every_s:
            best.offer(engine.global_steps, engine.module)
            last_eval = time.monotonic()
        inputs, labels, mask, v, i = _batch(train_data, values, ids, size, seed_r, engine.global_steps)
        if values is None:
            with torch.no_grad():
                v = torch.log_softmax(target.model(input_ids=inputs).logits.float() / t_loss, -1)
        logits = engine(input_ids=inputs).logits
        loss, kl = distill_loss(logits, v, i, labels, mask, t_loss)
        engine.backward(loss.to(dtype) if dtype else loss)
        before_step = engine.global_steps
        engine.step()
        if engine.global_steps == before_step and not engine.skipped_steps:
            raise RuntimeError("DeepSpeed's engine did not advance its step count")
        recent = (recent + [kl])[-20:]
        bar.set_postfix(step=engine.global_steps, kl=f"{sum(recent) / len(recent):.3f}",
                        best=f"{best.score:.3f}@{best.step}", refresh=False)
        bar.update(1) if steps else bar.update(round(time.monotonic() - start) - bar.n)
        if time.monotonic() - last_ckpt >= checkpoint_every_s:
            engine.save_checkpoint(str(ckpt), tag=f"step{engine.global_steps}",
                                   client_state={"elapsed_s": time.monotonic() - start})
            _prune(ckpt)
            last_ckpt = time.monotonic()
    bar.close()
    trained_s = time.monotonic() - start
    engine.save_checkpoint(str(ckpt), tag=f"step{engine.global_steps}",
                           client_state={"elapsed_s": trained_s})
    _prune(ckpt)
    best.offer(engine.global_steps, engine.module)
    kept = load_model(student_path).model.float()
    kept.load_state_dict(best.state() or engine.module.state_dict())
    log(f"kept the weights of step {best.step} (validation acceptance {best.score:.4f})")
    save_hf(kept, Path(target_path), out)
    reloaded = load_model(out).model
    after = served_acceptance(target.model, reloaded, held_data, temps)
    log("held-out after:  " + _fmt(after))
    guard = None
    if guard_data is not None:
        guard_after = served_acceptance(target.model, reloaded, guard_data, temps)
        log("guard set after:  " + _fmt(guard_after))
        guard = {"before": guard_before, "after": guard_after, "delta": _delta(guard_before, guard_after)}
    report = {"role": role, "target": str(target.path), "student": str(student.path),
              "temperature": temps[0] if len(temps) == 1 else temps, "loss_temperature": t_loss,
              "trainer": "deepspeed",
              "deepspeed": {"global_steps": engine.global_steps,
                            "optimizer": type(optimizer).__name__,
                            "inner_optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
                            "zero_stage": engine.zero_optimization_stage(),
                            "bf16": engine.bfloat16_enabled(), "config": config},
              "data": {"train_rows": len(train_idx), "heldout_rows": len(held_idx),
                       "train_tokens": int(train_data.loss_mask().sum()),
                       "classes": sorted(set(data.classes)), "teacher_top_k": top_k,
                       "teacher_mass": round(mass, 4), "teacher_s": round(teacher_s, 1)},
              "train": {"seconds": round(trained_s, 1), "final_kl": round(sum(recent) / max(1, len(recent)), 4)
                        if recent else None,
                        "kept_step": best.step, "validation_rows": len(val),
                        "validation": best.history},
              "heldout": {"before": before, "after": after, "delta": _delta(before, after)},
              "guard": guard}
    write_report(out, report)
    return report


class _Best:
    """The best student so far by validation acceptance at the served temperature (all classes,
    token-weighted): its weights in `path` (rewritten only when beaten), its step, score and
    every score so far beside it (`path` with .json), so a resumed run still knows them."""

    def __init__(self, path: Path, target, val: DistillData, temperatures: list[float]):
        self.path, self.target, self.val, self.temperatures = path, target, val, temperatures
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
        score = served_acceptance(self.target, module, self.val, self.temperatures)["all"]["acceptance"]
        module.train()
        self.history.append([step, score])
        if score > self.score:
            self.step, self.score = step, score
            torch.save({k: v.detach().float().clone() for k, v in module.state_dict().items()}, self.path)
        self.record.write_text(json.dumps({"step": self.step, "score": self.score, "history": self.history}))

    def state(self) -> dict | None:
        """The kept weights (fp32), or None without a validation set (the last weights stand)."""
        return torch.load(self.path) if self.val.classes and self.path.exists() else None


def _delta(before: dict, after: dict) -> dict:
    return {c: round(after[c]["acceptance"] - before[c]["acceptance"], 4) for c in after if c in before}


def _fmt(acc: dict) -> str:
    return "  ".join(f"{c}: acc {v['acceptance']:.3f} greedy {v['greedy']:.3f}" for c, v in acc.items())
