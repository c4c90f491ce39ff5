"""The distillation loss against the teacher's full distribution, with its gradient written out.

`models.distill.distill_loss` with the teacher's log-probs over the whole vocabulary (the
on-policy steps, where the teacher scores fresh continuations) spends most
of a small draft's step in autograd's element-wise passes over [positions, vocabulary], many
times its forward (docs/decisions/0035-sampled-objective.md). Here the loss and its gradient
are computed together, a block of positions at a time, skipping the positions the mask leaves
out:

  q = softmax(z / T), p = the teacher's, s = sign(p - q)
  total variation  1/2 sum |p - q|        d/dz = -q (s - sum(s q)) / (2 T)
  forward KL       sum p (log p - log q)  d/dz = (q - p) / T
  cross-entropy    -log softmax(z)[y]      d/dz = softmax(z) - onehot(y)

The same values and gradients as autograd's (tests/models/test_distill_objective.py).
"""

from __future__ import annotations

import torch

BLOCK = 256          # positions per block: [256, 8192] fp32 is 8 MiB, inside a core's L2 + L3 share


class _FullVocabLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, teacher_log, targets, mask, temperature, ce_weight, divergence):
        flat = logits.flatten(0, -2)
        rows = mask.flatten().nonzero().squeeze(1)
        n = max(1, rows.numel())
        grad = torch.zeros_like(flat)
        div_sum = torch.zeros((), dtype=torch.float64)
        ce_sum = torch.zeros((), dtype=torch.float64)
        p_flat, y_flat = teacher_log.flatten(0, -2), targets.flatten()
        for start in range(0, rows.numel(), BLOCK):
            idx = rows[start:start + BLOCK]
            z = flat[idx].float()
            logq = torch.log_softmax(z / temperature, -1)
            q = logq.exp()
            p_log = p_flat[idx].float()
            p = p_log.exp()
            if divergence == "kl":
                div_sum += (p * (p_log - logq)).sum()
                g = (q - p) / temperature
            else:
                diff = p - q
                div_sum += 0.5 * diff.abs().sum()
                s = diff.sign_()
                g = q * (s - (s * q).sum(-1, keepdim=True)) * (-0.5 / temperature)
            y = y_flat[idx]
            if temperature == 1.0:
                log1, q1 = logq, q
            else:
                log1 = torch.log_softmax(z, -1)
                q1 = log1.exp()
            ce_sum -= log1.gather(-1, y[:, None]).sum()
            g += ce_weight * q1
            g[torch.arange(len(idx)), y] -= ce_weight
            grad[idx] = (g / n).to(grad.dtype)
        ctx.save_for_backward(grad)
        ctx.shape = logits.shape
        div = (div_sum / n).float()
        return div + ce_weight * (ce_sum / n).float(), div

    @staticmethod
    def backward(ctx, grad_loss, _grad_div):
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss.to(grad.dtype)).view(ctx.shape), None, None, None, None, None, None


def full_vocab_loss(student_logits, teacher_log, targets, mask, temperature: float,
                    ce_weight: float, divergence: str) -> tuple[torch.Tensor, float]:
    """(loss, divergence) as `models.distill.distill_loss` gives them with `top_ids` None."""
    loss, div = _FullVocabLoss.apply(student_logits, teacher_log, targets, mask.bool(),
                                     float(temperature), float(ce_weight), divergence)
    return loss, div.item()
