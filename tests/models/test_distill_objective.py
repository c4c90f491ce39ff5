"""The distillation objective's parts, without DeepSpeed: the losses (top-k with a tail
bucket, total variation, the full-vocabulary loss with its gradient written out), the
on-policy rows (the student's or the target's fresh continuations, several steps a draw),
and the choice of the kept weights within the swap guard's drops."""

import pytest

from models.loader import load_model


def test_top_k_cache_keeps_the_tail_as_one_bucket():
    import torch

    from models.distill import distill_loss

    torch.manual_seed(0)
    teacher = torch.randn(1, 3, 50).log_softmax(-1)
    student = torch.randn(1, 3, 50, requires_grad=True)
    top = teacher.topk(5, -1)
    targets, mask = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool)
    _, kl_top = distill_loss(student, top.values, top.indices, targets, mask, 1.0, 0.0)
    _, kl_full = distill_loss(student, teacher, None, targets, mask, 1.0, 0.0)
    assert 0 <= kl_top <= kl_full + 1e-6     # a coarser partition: KL never larger, never < 0
    _, same = distill_loss(teacher.clone(), top.values, top.indices, targets, mask, 1.0, 0.0)
    assert abs(same) < 1e-4
    # A student that matches the top-k and drops the tail is not a perfect student: without the
    # tail bucket the truncated KL would call it better than perfect (negative).
    greedy = torch.full_like(teacher, -30.0).scatter(-1, top.indices, top.values)
    _, tailless = distill_loss(greedy, top.values, top.indices, targets, mask, 1.0, 0.0)
    assert tailless > 1.0


def test_total_variation_is_one_minus_the_acceptance():
    """--divergence tv: 1/2 sum |p - q| at the loss temperature, which is 1 - sum min(p, q), the
    acceptance of a token drafted at that temperature; coarser with the top-k cache, never < 0."""
    import torch

    from models.distill import distill_loss

    torch.manual_seed(1)
    teacher = (torch.randn(2, 3, 40) * 2).log_softmax(-1)
    student = torch.randn(2, 3, 40)
    targets, mask = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False
    for t in (1.0, 0.7):
        p, q = (teacher / t).softmax(-1), (student / t).softmax(-1)
        want = (1 - torch.minimum(p, q).sum(-1))[mask].mean().item()
        _, tv = distill_loss(student, (teacher / t).log_softmax(-1), None, targets, mask, t, 0.0,
                             divergence="tv")
        assert tv == pytest.approx(want, abs=1e-5)
    top = teacher.topk(6, -1)
    _, tv_top = distill_loss(student, top.values, top.indices, targets, mask, 1.0, 0.0, divergence="tv")
    _, tv_full = distill_loss(student, teacher, None, targets, mask, 1.0, 0.0, divergence="tv")
    assert 0 <= tv_top <= tv_full + 1e-6
    with pytest.raises(ValueError, match="divergence"):
        distill_loss(student, teacher, None, targets, mask, 1.0, divergence="js")


@pytest.mark.parametrize("divergence", ["tv", "kl"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_full_vocabulary_loss_has_autograds_value_and_gradient(divergence, temperature):
    """The on-policy steps' loss (the teacher's whole distribution) with its gradient written
    out (models/distill_fused.py) equals the autograd expression, positions the mask leaves
    out included (their gradient is zero), across more than one block of positions."""
    import torch

    from models import distill_fused
    from models.distill import _autograd_loss, distill_loss

    g = torch.Generator().manual_seed(3)
    B, L, V = 3, 7, 50
    teacher = torch.log_softmax(torch.randn(B, L, V, generator=g) * 2, -1)
    targets = torch.randint(V, (B, L), generator=g)
    mask = (torch.rand(B, L, generator=g) > 0.3).float()
    base = torch.randn(B, L, V, generator=g, dtype=torch.float64) * 2
    z1, z2 = base.clone().requires_grad_(), base.clone().requires_grad_()
    old_block = distill_fused.BLOCK
    distill_fused.BLOCK = 4                   # several blocks over the 15 or so kept positions
    try:
        loss1, div1 = distill_loss(z1, teacher, None, targets, mask, temperature, divergence=divergence)
    finally:
        distill_fused.BLOCK = old_block
    loss2, div2 = _autograd_loss(z2, teacher, None, targets, mask, temperature, 0.1, divergence)
    (3 * loss1).backward()
    (3 * loss2).backward()
    assert abs(div1 - div2) < 1e-5 and abs(loss1.item() - loss2.item()) < 1e-5
    assert torch.allclose(z1.grad, z2.grad, atol=1e-6), (z1.grad - z2.grad).abs().max()
    assert z1.grad[mask == 0].abs().max() == 0


def test_on_policy_rows_are_the_students_own_continuations(tiny_family):
    """The rows an on-policy step trains on: each prompt as given, continued by the student (here
    greedy, to compare with its argmax token by token), prompts of unequal length side by side."""
    import torch

    from models.distill import DistillData, student_rollouts

    student = load_model(tiny_family["draft"]).model.eval()
    rows = [([5, 9, 17, 3, 22, 40], [7, 7, 7], "code"), ([11, 4], [1, 2, 3, 4, 5, 6], "chat")]
    data = DistillData.from_rows(rows)
    out = student_rollouts(student, data, 5, 0.0)
    assert out.classes == ["code", "chat"]
    assert out.prompt_lens.tolist() == [6, 2] and out.lengths.tolist() == [11, 7]
    for r, (prompt, _, _) in enumerate(rows):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(5):
                ids.append(int(student(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.tokens[r, :len(ids)].tolist() == ids
    first = out.tokens[1, 2].item()                  # an eos ends the row after it
    ended = student_rollouts(student, data.subset([1]), 5, 0.0, (first,))
    assert ended.tokens[0, :int(ended.lengths[0])].tolist() == [11, 4, first]
    sampled = [student_rollouts(student, data, 5, 1.0).tokens for _ in range(3)]
    assert not all(torch.equal(sampled[0], x) for x in sampled[1:])     # sampled at T = 1


def test_on_policy_rows_are_drawn_several_steps_at_a_time(tiny_family):
    """One generation serves `steps_per_draw` steps of `size` rows, each row a training prompt
    continued by the student; the next step after them draws again, from the student as it is then."""
    from types import SimpleNamespace

    import torch

    from models.distill import DistillData, student_rollouts
    from models.distill_rollouts import Rollouts

    student = load_model(tiny_family["draft"]).model.eval()
    data = DistillData.from_rows([([3 + i, 8, 9 + i], [4, 4, 4, 4], f"c{i}") for i in range(5)])
    pool = Rollouts(data, size=2, seed=0, temperature=0.0, steps_per_draw=3)
    engine = SimpleNamespace(module=student)
    seen = [pool.batch(engine, step) for step in range(3)]
    assert not pool.pool
    for inputs, labels, mask, v, i in seen:
        assert inputs.shape[0] == 2 and v is None and i is None
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
        for row, m in zip(torch.cat([inputs, labels[:, -1:]], 1), mask):
            n = int(m.sum()) + 1
            k = next(k for k in range(5) if data.tokens[k, :3].tolist() == row[:3].tolist())
            want = student_rollouts(student, data.subset([k]), 4, 0.0)
            assert row[:n].tolist() == want.tokens[0].tolist()
    with torch.no_grad():                                  # the student changes: the next draw follows
        for w in student.parameters():
            w.mul_(-1)
    inputs, _, _, _, _ = pool.batch(engine, 3)
    assert len(pool.pool) == 2
    k = next(k for k in range(5) if data.tokens[k, :3].tolist() == inputs[0, :3].tolist())
    now = student_rollouts(student, data.subset([k]), 4, 0.0)
    assert inputs[0, 3:6].tolist() == now.tokens[0, 3:6].tolist()


def test_rollouts_written_by_the_target(tiny_family):
    """`--rollouts target`: the fresh rows of an on-policy step are the target's continuations
    through the engine (the distribution a served context follows), not the student's; a draw
    serves `steps_per_draw` steps."""
    from types import SimpleNamespace

    import torch

    from models.distill import DistillData
    from models.distill_rollouts import Rollouts, TargetWriter

    student = load_model(tiny_family["draft"]).model.eval()
    target = load_model(tiny_family["target"]).model.eval()
    with torch.no_grad():                      # a student that continues otherwise than the target
        for w in student.parameters():
            w.mul_(-1)
    data = DistillData.from_rows([([3 + i, 8, 9 + i], [4, 4, 4, 4], f"c{i}") for i in range(4)])
    pool = Rollouts(data, size=2, seed=0, temperature=0.0, steps_per_draw=2,
                    writer=TargetWriter(tiny_family["target"], threads=1))
    batches = [pool.batch(SimpleNamespace(module=student), step) for step in range(2)]
    assert not pool.pool
    for inputs, labels, mask, teacher, top_ids in batches:
        assert top_ids is None
        for row, m, v in zip(torch.cat([inputs, labels[:, -1:]], 1), mask, teacher):
            k = next(k for k in range(4) if data.tokens[k, :3].tolist() == row[:3].tolist())
            ids = data.tokens[k, :3].tolist()
            with torch.no_grad():                      # the target's greedy continuation
                for _ in range(4):
                    ids.append(int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
                want = torch.log_softmax(target(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
            assert row[:len(ids)].tolist() == ids
            # the loss covers the continuation, scored by the rows the writer sampled from
            assert m.tolist() == [False, False, True, True, True, True] + [False] * (len(m) - 6)
            assert (v[m].exp() - want[2:].exp()).abs().max() < 0.02
    one = DistillData.from_rows([([5, 9, 17], [4] * 8, "c")])    # sampled: every row its own draw
    pool = Rollouts(one, size=2, seed=0, temperature=1.0, steps_per_draw=2, writer=pool.writer)
    rows = [tuple(r.tolist()) for step in range(2)
            for r in pool.batch(SimpleNamespace(module=student), step)[1]]
    assert len(set(rows)) > 1


def test_the_target_writer_samples_each_row_by_its_seed(tiny_family):
    """At temperature 1 a row's continuation is a function of its seed alone: the same seeds
    give the same rows whatever else is in the batch, other seeds other rows."""
    from models.distill_rollouts import TargetWriter

    writer = TargetWriter(tiny_family["target"], threads=1, max_num_seqs=2)
    prompts = [[5, 9, 17], [11, 4], [3, 3, 3, 3]]
    first = writer.continuations(prompts, 12, 1.0, [1, 2, 3])
    again = writer.continuations(prompts[::-1], 12, 1.0, [3, 2, 1])
    assert again[::-1] == first
    other = writer.continuations(prompts, 12, 1.0, [4, 5, 6])
    assert other != first


def test_the_share_of_on_policy_steps():
    from models.distill_train import _on_policy_step

    assert not any(_on_policy_step(3, s, 0.0) for s in range(200))
    assert all(_on_policy_step(3, s, 1.0) for s in range(200))
    half = [_on_policy_step(3, s, 0.5) for s in range(400)]
    assert 160 < sum(half) < 240
    assert half == [_on_policy_step(3, s, 0.5) for s in range(400)]    # a resumed run draws the same


def test_the_kept_weights_are_the_best_the_swap_guard_takes():
    """Early stopping picks the best validation score among the steps whose classes each stay
    within the guard's drop of the given draft's: the later, higher-scoring step lost the
    replayed class and would be refused by the swap."""
    from models.distill_best import guarded_best

    history = [[0, 0.70, {"creative": 0.60, "replay": 0.75}],
               [50, 0.80, {"creative": 0.85, "replay": 0.50}],      # at the bound: taken
               [100, 0.85, {"creative": 0.90, "replay": 0.45}],     # past it
               [150, 0.80, {"creative": 0.80, "replay": 0.75}]]     # ties 50: the earlier kept
    assert guarded_best(history, 0.25) == [50, 0.80]
    assert guarded_best(history[:1], 0.25) == [0, 0.70]
    assert guarded_best([[0, 0.7, {"a": 0.7}], [9, 0.6, {"a": 0.6}]], 0.25) == [0, 0.7]
    assert guarded_best([[0, 0.7], [9, 0.8]], 0.25) == [9, 0.8]      # a record without classes
    assert guarded_best([], 0.25) is None
    # the replayed class allowed a larger drop (`--replay-drop`): step 100 is taken then
    assert guarded_best(history, 0.25, {"replay": 0.30}) == [100, 0.85]
    assert guarded_best(history, 0.25, {"creative": 0.30}) == [50, 0.80]
