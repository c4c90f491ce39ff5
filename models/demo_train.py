"""Training and evaluation of the demo family: next-token training, distillation, held-out figures.

Owns: building a standard `LlamaForCausalLM` from a `ModelShape`, one step-budgeted training loop
(next-token cross-entropy, or distillation from a frozen teacher: KL to its soft labels plus a
little cross-entropy), initialising a draft from chosen target layers, and measuring held-out
cross-entropy and agreement with the target. Does not own: data (`models/demo_data.py`), stages,
caching or files (`models/demo.py`).

The loop runs exactly `steps` optimizer steps on a schedule (warm-up, cosine to a floor) that
depends on the step alone: the same seed gives the same weights on a fast or a busy machine; the
progress bar shows the ETA.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.demo_data import eval_windows, sample_windows


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    mlp: int
    head_dim: int = 64

    def __post_init__(self):
        if self.hidden % self.head_dim:
            raise ValueError(f"hidden {self.hidden} is not a multiple of head_dim {self.head_dim}")

    @property
    def heads(self) -> int:
        return self.hidden // self.head_dim

    def as_list(self) -> list[int]:
        return [self.layers, self.hidden, self.heads, self.mlp]


@dataclass(frozen=True)
class StagePlan:
    steps: int            # optimizer steps
    batch_size: int
    seq_len: int
    lr: float
    seed: int
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    ce_weight: float = 0.1    # with a teacher: loss = KL(teacher || student) + ce_weight * CE


def llama_config(shape: ModelShape, vocab_size: int, max_positions: int = 2048):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=shape.hidden, intermediate_size=shape.mlp,
                       num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                       num_key_value_heads=shape.heads, head_dim=shape.head_dim,
                       max_position_embeddings=max_positions, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def build_model(shape: ModelShape, vocab_size: int, seed: int):
    """A fresh model whose blocks start as the identity: attention and MLP output projections
    are zero (as in modded-nanogpt), which shortens the early plateau of a short run."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(shape, vocab_size))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def draft_from_target(target, layers: list[int], seed: int):
    """A draft of the target's width whose layers start as copies of the target's `layers`."""
    from transformers import LlamaForCausalLM

    config = target.config.to_dict()
    config = type(target.config)(**{**config, "num_hidden_layers": len(layers)})
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(config)
    source = target.state_dict()
    state = {k: v for k, v in source.items() if not k.startswith("model.layers.")}
    for new, old in enumerate(layers):
        prefix = f"model.layers.{old}."
        state.update({f"model.layers.{new}.{k[len(prefix):]}": v for k, v in source.items()
                      if k.startswith(prefix)})
    draft.load_state_dict({k: v.clone() for k, v in state.items()}, strict=True)
    return draft


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _lr(plan: StagePlan, step: int) -> float:
    warmup = min(1.0, (step + 1) / max(1, plan.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, step / plan.steps)))
    return plan.lr * warmup * (plan.min_lr_ratio + (1 - plan.min_lr_ratio) * cosine)


def cpu_has_bf16() -> bool:
    """AVX-512 BF16 or AMX: there bf16 matmuls run faster than fp32; elsewhere slower
    (docs/decisions/0003-dtype-auto.md)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def train_dtype(device: torch.device) -> str:
    return "bf16-autocast" if device.type == "cuda" or cpu_has_bf16() else "float32"


def _autocast(device: torch.device, training: bool = True):
    """Training in bf16 autocast where it is fast (fp32 master weights); evaluation in bf16 on
    CUDA only, so the CPU figures are those of fp32 serving."""
    if device.type == "cuda" or (training and cpu_has_bf16()):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _optimizer(model, lr: float, device: torch.device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def train(model, stream: torch.Tensor, plan: StagePlan, device: torch.device, desc: str,
          teacher=None) -> dict:
    """Train `model` in place on windows of `stream` `[num_tokens]`; return the stage's record."""
    from tqdm.auto import tqdm

    model.to(device).train()
    if teacher is not None:
        teacher.to(device).eval()
    optimizer = _optimizer(model, plan.lr, device)
    generator = torch.Generator().manual_seed(plan.seed)
    tokens, recent = 0, []
    start = time.monotonic()
    bar = tqdm(total=plan.steps, desc=desc, unit="step", mininterval=2.0, dynamic_ncols=True)
    for step in range(plan.steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr(plan, step)
        batch = sample_windows(stream, plan.batch_size, plan.seq_len, generator).to(device)
        inputs, labels = batch[:, :-1], batch[:, 1:]                  # [batch_size, seq_len]
        with _autocast(device):
            logits = model(input_ids=inputs).logits                      # [batch_size, seq_len, vocab_size]
        logits = logits.float().flatten(0, 1)                           # [num_tokens, vocab_size]
        ce = F.cross_entropy(logits, labels.reshape(-1))
        loss = ce
        if teacher is not None:
            with torch.no_grad(), _autocast(device):
                teacher_logits = teacher(input_ids=inputs).logits
            teacher_logp = F.log_softmax(teacher_logits.float().flatten(0, 1), dim=-1)
            kl = F.kl_div(F.log_softmax(logits, dim=-1), teacher_logp, log_target=True,
                          reduction="batchmean")
            loss = kl + plan.ce_weight * ce
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += inputs.numel()
        recent = (recent + [loss.item()])[-20:]
        bar.update(1)
        bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}",
                        tok_s=f"{tokens / max(1e-9, time.monotonic() - start):.0f}", refresh=False)
    bar.close()
    seconds = time.monotonic() - start
    model.eval()
    return {"steps": plan.steps, "tokens": tokens,
            "seconds": round(seconds, 1), "tokens_per_s": round(tokens / max(seconds, 1e-9)),
            "train_loss": round(sum(recent) / max(1, len(recent)), 4)}


@torch.no_grad()
def evaluate(models: dict, stream: torch.Tensor, num_tokens: int, seq_len: int,
             device: torch.device, batch_size: int = 8) -> dict:
    """Held-out CE of each model; for each non-target model its agreement with `models['target']`.

    Agreement per position, teacher-forced: `greedy` = P(argmax q == argmax p); `t1` and `t07` =
    sum(min(p, q)) at temperature 1 and 0.7, the expected acceptance of a sampled draft token.
    """
    windows = eval_windows(stream, num_tokens, seq_len)             # [num_windows, seq_len + 1]
    sums = {role: {"ce": 0.0, "greedy": 0.0, "t1": 0.0, "t07": 0.0} for role in models}
    count = 0
    for start in range(0, len(windows), batch_size):
        batch = windows[start:start + batch_size].to(device)
        inputs, labels = batch[:, :-1], batch[:, 1:].reshape(-1)
        logits = {}
        for role, model in models.items():
            with _autocast(device, training=False):
                out = model(input_ids=inputs).logits
            logits[role] = out.float().flatten(0, 1)                  # [num_tokens, vocab_size]
            sums[role]["ce"] += F.cross_entropy(logits[role], labels, reduction="sum").item()
        p = logits["target"]
        for role in models:
            if role == "target":
                continue
            q = logits[role]
            sums[role]["greedy"] += (q.argmax(-1) == p.argmax(-1)).sum().item()
            for key, temperature in (("t1", 1.0), ("t07", 0.7)):
                overlap = torch.minimum(F.softmax(p / temperature, -1), F.softmax(q / temperature, -1))
                sums[role][key] += overlap.sum().item()
        count += labels.numel()
    result = {"tokens": count}
    for role, values in sums.items():
        result[role] = {"ce": round(values["ce"] / count, 4)}
        if role != "target":
            result[role]["acceptance_vs_target"] = {k: round(values[k] / count, 4)
                                                    for k in ("greedy", "t1", "t07")}
    return result


@torch.no_grad()
def greedy_sample(model, tokenizer, prompt: str, max_new_tokens: int, device: torch.device) -> str:
    """The model's greedy continuation of `prompt`, started after an EOT as files are in training."""
    ids = [0] + tokenizer(prompt, add_special_tokens=False).input_ids
    inputs = torch.tensor([ids], device=device)
    out = model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return prompt + tokenizer.decode(out[0, len(ids):].tolist())
