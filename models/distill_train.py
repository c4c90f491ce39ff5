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

from models.distill import (DistillData, acceptance_by_class, default_ds_config, distill_loss,
                            init_deepspeed, save_hf, split_heldout, teacher_topk, write_report)
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
                temperature: float = 1.0, steps: int | None = None, minutes: float | None = None,
                ds_config: dict | None = None, heldout: float = 0.15, seed: int = 0,
                role: str = "draft", top_k: int = 64, checkpoint_every_s: float = 120.0, log=print) -> dict:
    """Train the student in `student_path` towards the target on `data`; write `out`.

    `steps` counts DeepSpeed optimizer steps in total (a resumed run continues to it);
    `minutes` bounds the training time, previous attempts included. Returns the report.
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
    train_idx, held_idx = split_heldout(data.classes, heldout, seed)
    train_data, held_data = data.subset(train_idx), data.subset(held_idx)

    cache = out / "teacher.pt"
    t0 = time.monotonic()
    if not top_k:                     # the teacher runs beside the student, every step
        values = ids = None
        mass = 1.0
    elif cache.exists():
        values, ids, mass = torch.load(cache).values()
    else:
        values, ids, mass = teacher_topk(target.model, train_data, temperature, min(top_k, target.vocab_size))
        torch.save({"values": values, "ids": ids, "mass": mass}, cache)
    teacher_s = time.monotonic() - t0
    log(f"teacher top-{top_k or 'all'}: {mass:.3f} of the probability mass, {teacher_s:.0f} s")

    before_file = out / "before.json"
    if before_file.exists():
        before = json.loads(before_file.read_text())
    else:
        before = acceptance_by_class(target.model, student.model, held_data, temperature)
        before_file.write_text(json.dumps(before))
    log("held-out before: " + _fmt(before))

    config = ds_config or default_ds_config()
    model = student.model.float().train()
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
    while True:
        done = time.monotonic() - start
        if (steps and engine.global_steps >= steps) or (budget_s and done >= budget_s):
            break
        inputs, labels, mask, v, i = _batch(train_data, values, ids, size, seed_r, engine.global_steps)
        if values is None:
            with torch.no_grad():
                v = torch.log_softmax(target.model(input_ids=inputs).logits.float() / temperature, -1)
        logits = engine(input_ids=inputs).logits
        loss, kl = distill_loss(logits, v, i, labels, mask, temperature)
        engine.backward(loss.to(dtype) if dtype else loss)
        before_step = engine.global_steps
        engine.step()
        if engine.global_steps == before_step and not engine.skipped_steps:
            raise RuntimeError("DeepSpeed's engine did not advance its step count")
        recent = (recent + [kl])[-20:]
        bar.set_postfix(step=engine.global_steps, kl=f"{sum(recent) / len(recent):.3f}", refresh=False)
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
    save_hf(engine.module, Path(target_path), out)
    after = acceptance_by_class(target.model, load_model(out).model, held_data, temperature)
    log("held-out after:  " + _fmt(after))
    report = {"role": role, "target": str(target.path), "student": str(student.path),
              "temperature": temperature, "trainer": "deepspeed",
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
                        if recent else None},
              "heldout": {"before": before, "after": after,
                          "delta": {c: round(after[c]["acceptance"] - before[c]["acceptance"], 4)
                                    for c in after if c in before}}}
    write_report(out, report)
    return report


def _fmt(acc: dict) -> str:
    return "  ".join(f"{c}: acc {v['acceptance']:.3f} greedy {v['greedy']:.3f}" for c, v in acc.items())
