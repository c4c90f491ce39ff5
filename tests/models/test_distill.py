"""Distillation through DeepSpeed on tiny models: the engine's continuations, DeepSpeed's steps,
held-out agreement that rises, resumable checkpoints, refused tokenizers."""

import json
import shutil

import pytest

from cluster.cli import main
from models.distill_prompts import builtin_prompts, read_prompts, write_prompts
from models.loader import load_model


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    write_prompts(path, builtin_prompts(30))
    return path


def _distill(family, prompts, out, *extra):
    return main(["draft", "distill", "--target", str(family["target"]), "--draft", str(family["draft"]),
                 "--prompts", str(prompts), "--out", str(out), "--new-tokens", "24", "--threads", "1",
                 "--heldout", "0.25", *extra])


@pytest.fixture(scope="module")
def distilled(tiny_family, prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("distilled")
    # --top-k 0: the teacher runs beside the student (exact KL); the tiny target is too flat
    # for a top-64 cache of its 320 tokens (0.42 of the mass), which the reference family is not.
    assert _distill(tiny_family, prompts, out, "--steps", "60", "--top-k", "0") == 0
    return out


def test_deepspeed_runs_the_steps_and_acceptance_rises(distilled):
    report = json.loads((distilled / "distill.json").read_text())
    ds = report["deepspeed"]
    assert report["trainer"] == "deepspeed"
    assert ds["global_steps"] == 60                       # DeepSpeed's own step counter
    assert ds["optimizer"] == "DeepSpeedZeroOptimizer"    # ZeRO stage 1 from the default config
    assert ds["inner_optimizer"] == "AdamW" and ds["zero_stage"] == 1
    before, after = report["heldout"]["before"], report["heldout"]["after"]
    assert set(before) == {"all", "chat", "code", "prose"}
    assert after["all"]["kl"] < 0.7 * before["all"]["kl"]
    assert after["all"]["acceptance"] > before["all"]["acceptance"] + 0.02


def test_output_is_a_checkpoint_the_loader_accepts(distilled, tiny_family):
    target = load_model(tiny_family["target"])
    student = load_model(distilled)
    assert student.vocab_size == target.vocab_size
    assert student.tokenizer.get_vocab() == target.tokenizer.get_vocab()


def test_resume_continues_from_the_deepspeed_checkpoint(distilled, tiny_family, prompts, tmp_path, capsys):
    out = tmp_path / "resumed"
    shutil.copytree(distilled, out)
    assert _distill(tiny_family, prompts, out, "--steps", "65", "--top-k", "0") == 0
    assert "resumed" in capsys.readouterr().out
    report = json.loads((out / "distill.json").read_text())
    assert report["deepspeed"]["global_steps"] == 65


def test_refuses_a_tokenizer_that_differs(tiny_family, prompts, tmp_path, capsys):
    from tiny_models import make_llama, make_tokenizer

    other = tmp_path / "other"
    other.mkdir()
    tok = make_tokenizer(other, vocab_size=300)
    make_llama(other, tok)
    code = main(["draft", "distill", "--target", str(tiny_family["target"]), "--draft", str(other),
                 "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--steps", "2",
                 "--new-tokens", "4", "--threads", "1"])
    assert code == 1
    assert "vocabulary" in capsys.readouterr().err


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


def test_prompt_file_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match="prompt"):
        read_prompts(bad)


def test_swap_guard_refuses_a_class_that_got_worse(tmp_path):
    from cluster.cli.draft_swap import guard

    def report(after_chat):
        (tmp_path / "distill.json").write_text(json.dumps({"heldout": {
            "before": {"chat": {"acceptance": 0.50}, "code": {"acceptance": 0.70}},
            "after": {"chat": {"acceptance": after_chat}, "code": {"acceptance": 0.69}}}}))
        return guard(tmp_path)

    assert report(0.65) == []                      # code -0.01 is within 0.02
    assert "chat" in report(0.47)[0]               # chat -0.03 is refused
    (tmp_path / "distill.json").unlink()
    assert "distill.json" in guard(tmp_path)[0]
