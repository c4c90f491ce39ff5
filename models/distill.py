"""Distil a draft (or the small tier) on the target's own continuations, with DeepSpeed.

Owns: the distillation data (prompt + target continuation token rows, the target's top-k
log-probabilities over them, cached once), the DeepSpeed engine that trains the student (its
config: ZeRO stage, offload, bf16, optimizer, scheduler; its checkpoints, so a run resumes), the
loss (forward KL or total variation to the target at the serving temperature, plus a little
cross-entropy), the student's own continuations for on-policy steps, held-out
acceptance per prompt class, and the output: a standard Hugging Face folder with the target's
tokenizer. Does not own: generating the continuations (the engine does it; `cluster/cli/draft_distill.py`
wires them), prompts (`models/distill_prompts.py`), nor serving or swapping the result.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from models import GREEDY_BELOW
from models.rendezvous import free_port

TOP_K = 64          # teacher log-probs kept per position (their mass is reported)
CE_WEIGHT = 0.1


@dataclass
class DistillData:
    """Rows of `prompt + continuation` token ids, right-padded, with what the loss may read."""
    tokens: torch.Tensor        # [rows, length] int64, padded with 0
    lengths: torch.Tensor       # [rows] real tokens per row
    prompt_lens: torch.Tensor   # [rows] prompt tokens per row (the continuation follows)
    classes: list[str]          # [rows]

    @classmethod
    def from_rows(cls, rows: list[tuple[list[int], list[int], str]]) -> "DistillData":
        length = max(len(p) + len(c) for p, c, _ in rows)
        tokens = torch.zeros(len(rows), length, dtype=torch.long)
        for i, (p, c, _) in enumerate(rows):
            tokens[i, :len(p) + len(c)] = torch.tensor(p + c)
        return cls(tokens, torch.tensor([len(p) + len(c) for p, c, _ in rows]),
                   torch.tensor([len(p) for p, _, _ in rows]), [r[2] for r in rows])

    def subset(self, index: list[int]) -> "DistillData":
        idx = torch.tensor(index, dtype=torch.long)
        return DistillData(self.tokens[idx], self.lengths[idx], self.prompt_lens[idx],
                           [self.classes[i] for i in index])

    def loss_mask(self, completion_only: bool = False) -> torch.Tensor:
        """[rows, length - 1]: position t predicts token t + 1; True where that token is real
        (and, with `completion_only`, a continuation token)."""
        pos = torch.arange(self.tokens.shape[1] - 1)[None, :]
        mask = pos + 1 < self.lengths[:, None]
        if completion_only:
            mask &= pos + 1 >= self.prompt_lens[:, None]
        return mask

    def prompt_groups(self) -> list[bytes]:
        """One key per row: rows with the same prompt (its several continuations) share it."""
        return [self.tokens[i, :int(n)].numpy().tobytes() for i, n in enumerate(self.prompt_lens)]

    def save(self, path: Path) -> None:
        torch.save({"tokens": self.tokens, "lengths": self.lengths, "prompt_lens": self.prompt_lens,
                    "classes": self.classes}, path)

    @classmethod
    def load(cls, path: Path) -> "DistillData":
        d = torch.load(path)
        return cls(d["tokens"], d["lengths"], d["prompt_lens"], d["classes"])


def split_heldout(classes: list[str], fraction: float, seed: int = 0,
                  groups: list | None = None) -> tuple[list[int], list[int]]:
    """(train, held-out) row indices; every class keeps at least one held-out group. Rows of one
    group (one prompt's several continuations) fall on one side together, so a held-out prompt
    is one the student never trained on."""
    groups = groups if groups is not None else list(range(len(classes)))
    classes = [base_class(c) for c in classes]    # a prompt continued at two temperatures: one side
    g = torch.Generator().manual_seed(seed)
    train, held = [], []
    for cls in sorted(set(classes)):
        keys = list(dict.fromkeys(k for k, c in zip(groups, classes) if c == cls))
        keys = [keys[j] for j in torch.randperm(len(keys), generator=g).tolist()]
        n = max(1, round(len(keys) * fraction)) if len(keys) > 1 else 0
        out = set(keys[:n])
        for i, (k, c) in enumerate(zip(groups, classes)):
            if c == cls:
                (held if k in out else train).append(i)
    return sorted(train), sorted(held)


@torch.no_grad()
def teacher_topk(teacher, data: DistillData, temperature: float, k: int = TOP_K,
                 batch_size: int = 16) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The target's top-k log-probs at `temperature`, [rows, length - 1, k] (fp16 values,
    int32 ids), and the mean probability mass they cover on real positions."""
    rows, length = data.tokens.shape
    values = torch.zeros(rows, length - 1, k, dtype=torch.float16)
    ids = torch.zeros(rows, length - 1, k, dtype=torch.int32)
    mask = data.loss_mask()
    for s in range(0, rows, batch_size):
        logits = teacher(input_ids=data.tokens[s:s + batch_size]).logits[:, :-1].float()
        logp = F.log_softmax(logits / temperature, dim=-1)
        top = logp.topk(k, dim=-1)
        values[s:s + batch_size], ids[s:s + batch_size] = top.values.half(), top.indices.int()
    mass = values.float().exp().sum(-1)[mask].mean().item()
    return values, ids, mass


DIVERGENCES = ("kl", "tv")


def distill_loss(student_logits, top_values, top_ids, targets, mask, temperature: float,
                 ce_weight: float = CE_WEIGHT, divergence: str = "kl") -> tuple[torch.Tensor, float]:
    """The divergence from the teacher's p_T to the student's q_T, plus `ce_weight` x cross-entropy
    on the target's own tokens; (loss, divergence) averaged over `mask`.

    `divergence`: "kl", forward KL(p_T || q_T); "tv", total variation 1/2 sum |p_T - q_T|, which
    is 1 - the acceptance of a token drafted at T (docs/decisions/0035-sampled-objective.md).
    With `top_ids` None, `top_values` are the teacher's full log-probs; else they cover the
    teacher's top-k ids and one bucket holds the rest of the vocabulary (the exact divergence of
    that coarser distribution, so never negative and the tail is not left to grow)."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    if top_ids is None:                 # the loss and its gradient in one pass
        from models.distill_fused import full_vocab_loss

        return full_vocab_loss(student_logits, top_values, targets, mask, temperature, ce_weight,
                               divergence)
    return _autograd_loss(student_logits, top_values, top_ids, targets, mask, temperature,
                          ce_weight, divergence)


def _autograd_loss(student_logits, top_values, top_ids, targets, mask, temperature: float,
                   ce_weight: float, divergence: str) -> tuple[torch.Tensor, float]:
    """`distill_loss` as autograd's expression (the teacher's top-k with a tail bucket, or the
    whole vocabulary: models/distill_fused.py is the faster form of that case)."""
    logq = F.log_softmax(student_logits.float() / temperature, dim=-1)     # [B, L, V]
    p_log = top_values.float()                                             # [B, L, k or V]
    if top_ids is not None:
        q_log = logq.gather(-1, top_ids.long())
        p_rest = (1 - p_log.exp().sum(-1, keepdim=True)).clamp(min=1e-6)
        q_rest = (1 - q_log.exp().sum(-1, keepdim=True)).clamp(min=1e-6)
        p_log, logq = torch.cat([p_log, p_rest.log()], -1), torch.cat([q_log, q_rest.log()], -1)
    if divergence == "kl":
        div = (p_log.exp() * (p_log - logq)).sum(-1)
    else:
        div = 0.5 * (p_log.exp() - logq.exp()).abs().sum(-1)
    ce = F.cross_entropy(student_logits.float().flatten(0, 1), targets.flatten(),
                         reduction="none").view_as(div)
    m = mask.float()
    n = m.sum().clamp(min=1)
    div_mean = (div * m).sum() / n
    return div_mean + ce_weight * (ce * m).sum() / n, div_mean.item()


@torch.no_grad()
def student_rollouts(student, data: DistillData, new_tokens: int, temperature: float,
                     eos_ids: tuple[int, ...] = ()) -> DistillData:
    """On-policy rows: `data`'s prompts, each continued by the student itself (sampled at
    `temperature`, greedy below GREEDY_BELOW), `new_tokens` at most, ending after any of
    `eos_ids` (`models.loader.eos_token_ids`)."""
    lens = data.prompt_lens.tolist()
    width = max(lens)
    pad = eos_ids[0] if eos_ids else 0
    ids = torch.full((len(lens), width), pad, dtype=torch.long)      # left-padded prompts
    attn = torch.zeros(len(lens), width, dtype=torch.long)
    for r, n in enumerate(lens):
        ids[r, width - n:], attn[r, width - n:] = data.tokens[r, :n], 1
    sampled = temperature >= GREEDY_BELOW
    was_training = student.training
    student.eval()
    out = student.generate(input_ids=ids, attention_mask=attn, max_new_tokens=new_tokens,
                           do_sample=sampled, temperature=temperature if sampled else None,
                           top_k=0 if sampled else None, top_p=1.0 if sampled else None,
                           pad_token_id=pad, eos_token_id=list(eos_ids) or None)
    student.train(was_training)
    rows = []
    for r, n in enumerate(lens):
        cont = out[r, width:].tolist()
        ends = [i for i, t in enumerate(cont) if t in eos_ids]
        cont = cont[:ends[0] + 1] if ends else cont
        rows.append((data.tokens[r, :n].tolist(), cont or [pad], data.classes[r]))
    return DistillData.from_rows(rows)


class Recipe(NamedTuple):
    """The objective a run takes where none is given (`default_objective`)."""

    divergence: str               # "kl" or "tv" (`distill_loss`)
    on_policy: float              # the share of steps on fresh continuations
    rollouts: str                 # who writes them: "student" or "target"
    anneal: float                 # the budget's last share that takes the learning rate to 0


def default_objective(temperatures: float | list[float]) -> Recipe:
    """The objective where none is given. Where every served temperature samples: total
    variation (1 - acceptance) on fresh continuations the target writes through the engine, the
    learning rate annealed over the last 40% of the budget. Where greedy requests are served:
    forward KL on the target's cached continuations (argmax agreement is what is accepted then),
    no anneal. Both measured in docs/decisions/0035-sampled-objective.md and 0020."""
    temps = [temperatures] if isinstance(temperatures, (int, float)) else temperatures
    if min(temps) >= GREEDY_BELOW:
        return Recipe("tv", 1.0, "target", 0.4)
    return Recipe("kl", 0.0, "student", 0.0)


def loss_temperature(temperatures: float | list[float]) -> float:
    """The temperature the teacher's distribution is matched at: the (highest) served one, or 1
    when the draft serves greedy requests only (the argmax is what is accepted then; the whole
    distribution at 1 carries its ranking, and the CE term pulls on the argmax tokens)."""
    temps = [temperatures] if isinstance(temperatures, (int, float)) else temperatures
    return max((t for t in temps if t >= GREEDY_BELOW), default=1.0)


def at_temperature(cls: str, temperature: float) -> str:
    """The label of a class's rows continued at one of several served temperatures."""
    return f"{cls}@T{temperature:g}"


def base_class(label: str) -> str:
    return label.split("@T")[0]


def served_acceptance(target, student, data: DistillData, temperatures: list[float]) -> dict:
    """`acceptance_by_class` at the served temperature; with several, each temperature's rows
    (labelled `at_temperature`) at their own, keys `class@T..` and `all@T..`, and `all` the
    token-weighted whole."""
    if len(temperatures) == 1:
        return acceptance_by_class(target, student, data, temperatures[0])
    out: dict[str, dict] = {}
    for t in temperatures:
        rows = [i for i, c in enumerate(data.classes) if c.partition("@T")[2] == f"{t:g}"]
        if rows:
            part = acceptance_by_class(target, student, data.subset(rows), t)
            part[at_temperature("all", t)] = part.pop("all")
            out.update(part)
    parts = [v for k, v in out.items() if k.startswith("all@T")]
    n = sum(v["tokens"] for v in parts)
    out["all"] = {m: round(sum(v[m] * v["tokens"] for v in parts) / max(n, 1), 4)
                  for m in ("acceptance", "greedy", "kl")} | {"tokens": n}
    return dict(sorted(out.items()))


@torch.no_grad()
def acceptance_by_class(target, student, data: DistillData, temperature: float,
                        batch_size: int = 16) -> dict:
    """Teacher-forced agreement on the continuation tokens, per class and overall:
    `acceptance` = what a drafted token is accepted with at `temperature`: mean sum(min(p_T, q_T))
    when sampled, P(argmax q == argmax p) when greedy (temperature 0);
    `greedy` = P(argmax q == argmax p), `kl` = KL(p_T || q_T) in nats per token (T = 1 for greedy)."""
    sums: dict[str, list[float]] = {}
    mask = data.loss_mask(completion_only=True)
    t = loss_temperature(temperature)
    for s in range(0, len(data.classes), batch_size):
        inp = data.tokens[s:s + batch_size]
        p_log = F.log_softmax(target(input_ids=inp).logits[:, :-1].float() / t, -1)
        q_log = F.log_softmax(student(input_ids=inp).logits[:, :-1].float() / t, -1)
        greedy = (p_log.argmax(-1) == q_log.argmax(-1)).float()
        acc = torch.minimum(p_log.exp(), q_log.exp()).sum(-1) if temperature >= GREEDY_BELOW else greedy
        kl = (p_log.exp() * (p_log - q_log)).sum(-1)
        for r, cls in enumerate(data.classes[s:s + batch_size]):
            m = mask[s + r]
            for key in (cls, "all"):
                tot = sums.setdefault(key, [0.0, 0.0, 0.0, 0])
                tot[0] += acc[r][m].sum().item()
                tot[1] += greedy[r][m].sum().item()
                tot[2] += kl[r][m].sum().item()
                tot[3] += int(m.sum())
    return {c: {"acceptance": round(a / max(n, 1), 4), "greedy": round(g / max(n, 1), 4),
                "kl": round(k / max(n, 1), 4), "tokens": n} for c, (a, g, k, n) in sorted(sums.items())}


def default_ds_config(batch_size: int = 8, lr: float = 3e-4, zero_stage: int = 1) -> dict:
    """DeepSpeed's config for a single-node run: its AdamW (torch's implementation, which needs no
    C++ build), its warm-up schedule, ZeRO, bf16 where the device runs it fast."""
    from models.demo_train import cpu_has_bf16

    bf16 = torch.cuda.is_available() or cpu_has_bf16()
    return {"train_micro_batch_size_per_gpu": batch_size, "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95],
                                                      "weight_decay": 0.0, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                         "warmup_num_steps": 20}},
            "zero_optimization": {"stage": zero_stage}, "zero_force_ds_cpu_optimizer": False,
            "bf16": {"enabled": bf16}}


def init_deepspeed(model, ds_config: dict):
    """A DeepSpeed engine around `model`. Under the `deepspeed` launcher the rank variables are
    already set; alone, this process is rank 0 of 1 over gloo (no MPI)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import deepspeed

    if os.environ["WORLD_SIZE"] == "1":
        # One rank never calls DeepSpeed's shared-memory all-reduce, but its backend builds
        # that C++ op at start: tens of seconds of compiling, under a lock file that a process
        # killed mid-build leaves behind, and every later start then waits on it for ever.
        # (The submodule: the attribute `deepspeed.comm.torch` is the torch it imported.)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config)
    return engine, optimizer, scheduler


def save_hf(student, target_folder: Path, out: Path) -> None:
    """A standard HF checkpoint folder: the student's weights and config, the target's tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    student.save_pretrained(str(out))
    for f in Path(target_folder).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) and f.is_file():
            shutil.copy2(f, out / f.name)


def write_report(out: Path, report: dict) -> None:
    tmp = out / "distill.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out / "distill.json")


def now() -> float:
    return time.monotonic()
