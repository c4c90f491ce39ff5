"""Distillation through DeepSpeed on tiny models: the engine's continuations, DeepSpeed's steps,
held-out agreement that rises, resumable checkpoints, refused tokenizers."""

import json
import shutil

import pytest

from cluster.cli import main
from models.distill_prompts import builtin_prompts, read_prompts, write_prompts
from models.loader import load_model


@pytest.fixture(scope="module", autouse=True)
def own_process_group():
    """DeepSpeed makes a 1-rank process group in this process and keeps it (its comm module
    caches it across runs, so a run cannot end it). Ended with the module: a tensor-parallel
    test that later runs in this pytest process (pytest-xdist) makes its own default group."""
    import torch.distributed as dist

    had = dist.is_initialized()
    yield
    if not had and dist.is_initialized():
        dist.destroy_process_group()


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
    # served at T = 1 only: total variation on the target's fresh continuations (0035), no
    # top-k cache, the learning rate annealed over the last 40%
    assert report["objective"] == {"divergence": "tv", "on_policy": 1.0, "rollouts": "target"}
    assert report["data"]["teacher_top_k"] == 0
    assert report["train"]["anneal"] == 0.4 and report["train"]["last_lr"] < 1e-5
    before, after = report["heldout"]["before"], report["heldout"]["after"]
    assert set(before) == {"all", "chat", "code", "prose"}
    assert after["all"]["kl"] < 0.7 * before["all"]["kl"]
    assert after["all"]["acceptance"] > before["all"]["acceptance"] + 0.02


def test_output_is_a_checkpoint_the_loader_accepts(distilled, tiny_family):
    target = load_model(tiny_family["target"])
    student = load_model(distilled)
    assert student.vocab_size == target.vocab_size
    assert student.tokenizer.get_vocab() == target.tokenizer.get_vocab()
    held = read_prompts(distilled / "heldout_prompts.jsonl")
    assert len({r["prompt"] for r in held}) == len(held)          # one row per held-out prompt
    for cls in ("chat", "code", "prose"):                          # bench serve's --prompts layout
        assert read_prompts(distilled / "heldout" / f"{cls}.jsonl") == [r for r in held if r["class"] == cls]


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


@pytest.mark.parametrize("rollouts", ["student", "target"])
def test_an_on_policy_total_variation_run(tiny_family, prompts, tmp_path, rollouts):
    """--divergence tv --on-policy 1: every step on fresh continuations (the draft's own, or the
    target's through the engine), scored by the target in the step; the report names the objective."""
    out = tmp_path / "tv"
    assert _distill(tiny_family, prompts, out, "--steps", "6", "--top-k", "0", "--divergence", "tv",
                    "--on-policy", "1", "--rollouts", rollouts) == 0
    report = json.loads((out / "distill.json").read_text())
    assert report["objective"] == {"divergence": "tv", "on_policy": 1.0, "rollouts": rollouts}
    assert report["deepspeed"]["global_steps"] == 6
    assert 0 < report["train"]["final_divergence"] < 1          # a total variation


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
    # other traffic scored as a guard set: a drop there is refused as well
    report(0.65)
    saved = json.loads((tmp_path / "distill.json").read_text())
    saved["guard"] = {"before": {"code": {"acceptance": 0.80}}, "after": {"code": {"acceptance": 0.77}}}
    (tmp_path / "distill.json").write_text(json.dumps(saved))
    assert guard(tmp_path) == ["class 'code': guard-set acceptance 0.770 < 0.800 - 0.02"]
    # a class the report allows more (`draft distill --replay-drop`): refused only past it
    saved["guard"] = None
    saved["heldout"]["before"]["replay"], saved["heldout"]["after"]["replay"] = (
        {"acceptance": 0.80}, {"acceptance": 0.76})
    (tmp_path / "distill.json").write_text(json.dumps(saved))
    assert guard(tmp_path) == ["class 'replay': held-out acceptance 0.760 < 0.800 - 0.02"]
    saved["drops"] = {"replay": 0.05}
    (tmp_path / "distill.json").write_text(json.dumps(saved))
    assert guard(tmp_path) == []
    saved["heldout"]["after"]["replay"] = {"acceptance": 0.74}
    (tmp_path / "distill.json").write_text(json.dumps(saved))
    assert guard(tmp_path) == ["class 'replay': held-out acceptance 0.740 < 0.800 - 0.05"]
    (tmp_path / "distill.json").unlink()
    assert "distill.json" in guard(tmp_path)[0]


def test_held_out_prompts_never_trained_on():
    """With several continuations a prompt, the split is by prompt: a row-wise split put some
    of a held-out prompt's continuations in the training rows (measured agreement then
    included prompts the student had seen)."""
    import torch

    from models.distill import DistillData, split_heldout

    rows = [([p, p + 1, cls], [7, 8, 9 + s], "abc"[cls]) for p in range(2, 60, 2) for cls in range(3)
            for s in range(4)]
    data = DistillData.from_rows(rows)
    groups = data.prompt_groups()
    train, held = split_heldout(data.classes, 0.25, 0, groups)
    assert sorted(train + held) == list(range(len(rows)))
    assert not {groups[i] for i in train} & {groups[i] for i in held}
    assert {data.classes[i] for i in held} == {"a", "b", "c"}
    per_class = {c: len({groups[i] for i in held if data.classes[i] == c}) for c in "abc"}
    assert all(n == round(29 * 0.25) for n in per_class.values())
    assert torch.equal(data.subset(held).tokens[0, :3], data.tokens[held[0], :3])
    # the same prompts continued at two temperatures (labels `class@T..`): one side at both
    from models.distill import at_temperature

    labels = [at_temperature(c, t) for t in (0, 1) for c in data.classes]
    twice = groups + groups
    train, held = split_heldout(labels, 0.25, 0, twice)
    assert not {twice[i] for i in train} & {twice[i] for i in held}
    assert {labels[i] for i in held} == {at_temperature(c, t) for c in "abc" for t in (0, 1)}


def test_greedy_acceptance_is_argmax_agreement(tiny_family):
    """At temperature 0 a drafted token is accepted exactly when it is the target's argmax."""
    import torch

    from models.distill import DistillData, acceptance_by_class

    target, draft = load_model(tiny_family["target"]).model, load_model(tiny_family["draft"]).model
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randint(5, 300, (6,), generator=g).tolist(),
             torch.randint(5, 300, (10,), generator=g).tolist(), "x") for _ in range(4)]
    data = DistillData.from_rows(rows)
    greedy = acceptance_by_class(target, draft, data, 0.0)["x"]
    sampled = acceptance_by_class(target, draft, data, 1.0)["x"]
    assert greedy["acceptance"] == greedy["greedy"] == sampled["greedy"]
    assert greedy["acceptance"] != sampled["acceptance"]
    assert acceptance_by_class(target, target, data, 0.0)["x"]["acceptance"] == 1.0
    # several served temperatures: each row scored at its own, T0 rows apart from T10 rows
    from models.distill import served_acceptance

    two = DistillData.from_rows([(p, c, f"x@T{t}") for t in (0, 10) for p, c, _ in rows])
    both = served_acceptance(target, draft, two, [0.0, 10.0])
    assert both["x@T0"] == both["all@T0"] == {**greedy, "kl": both["x@T0"]["kl"]}
    assert both["x@T10"]["tokens"] == both["x@T0"]["tokens"] == greedy["tokens"]


def test_a_run_that_only_gets_worse_keeps_the_given_draft(tiny_family, prompts, tmp_path):
    """Early stopping: scored on validation prompts, a run whose training hurts (a learning rate
    far too high) hands back the draft it was given, not its last weights."""
    import torch

    from models.distill import default_ds_config

    config = default_ds_config(8, 3.0)
    config["scheduler"]["params"]["warmup_num_steps"] = 1
    (tmp_path / "ds.json").write_text(json.dumps(config))
    out = tmp_path / "worse"
    assert _distill(tiny_family, prompts, out, "--steps", "8", "--top-k", "0", "--ds-config",
                    str(tmp_path / "ds.json"), "--validation", "0.2") == 0
    report = json.loads((out / "distill.json").read_text())
    history = report["train"]["validation"]
    assert history[0][0] == 0 and history[-1][0] == 8
    assert history[-1][1] < history[0][1]                  # the training did hurt
    assert report["train"]["kept_step"] == 0
    given, kept = load_model(tiny_family["draft"]).model, load_model(out).model
    for (name, a), b in zip(given.state_dict().items(), kept.state_dict().values()):
        assert torch.equal(a.float(), b.float()), name
    assert report["heldout"]["after"] == report["heldout"]["before"]


def test_the_learning_rate_anneals_over_the_last_share_of_the_budget(tiny_family, prompts,
                                                                      tmp_path):
    """`--anneal SHARE`: the rate holds its peak, then falls linearly to 0 over the budget's
    last share (steps with a step budget, else time); the run ends at 0."""
    from models.distill_train import _Budget

    steps = _Budget(100, None, 1.0, 1.0, anneal=0.5)
    assert [steps.lr_scale(s, 0.0) for s in (0, 50, 75, 100)] == [1.0, 1.0, 0.5, 0.0]
    timed = _Budget(None, 200.0, 1.0, 1.0, anneal=0.25)
    assert [timed.lr_scale(999, t) for t in (0.0, 150.0, 175.0, 250.0)] == [1.0, 1.0, 0.5, 0.0]
    assert _Budget(100, None, 1.0, 1.0).lr_scale(99, 0.0) == 1.0
    last = {}
    for anneal in ("1", "0"):
        out = tmp_path / f"anneal{anneal}"
        assert _distill(tiny_family, prompts, out, "--steps", "4", "--top-k", "0",
                        "--anneal", anneal) == 0
        report = json.loads((out / "distill.json").read_text())
        assert report["train"]["anneal"] == float(anneal)
        last[anneal] = report["train"]["last_lr"]
    assert last["1"] == 0.0 and last["0"] > 0          # warming up still, without the anneal


def test_several_temperatures_and_a_guard_set(tiny_family, prompts, tmp_path):
    """Served at 0 and 1: continuations at each, each scored at its own (greedy rows as argmax
    agreement), one prompt on one side of the split at both; a guard set scored before and
    after, never trained on."""
    guard = tmp_path / "guard.jsonl"
    write_prompts(guard, builtin_prompts(4, seed=9))
    out = tmp_path / "multi"
    assert _distill(tiny_family, prompts, out, "--steps", "4", "--top-k", "0", "--temperature", "0,1",
                    "--samples", "2", "--guard-prompts", str(guard), "--replay", "4") == 0
    report = json.loads((out / "distill.json").read_text())
    assert report["temperature"] == [0.0, 1.0] and report["loss_temperature"] == 1.0
    assert report["objective"] == {"divergence": "kl", "on_policy": 0.0,       # greedy served too
                                   "rollouts": "student"}
    assert report["train"]["anneal"] == 0.0
    before = report["heldout"]["before"]
    assert {"chat@T0", "chat@T1", "code@T0", "prose@T1", "all@T0", "all@T1", "all"} <= set(before)
    for cls in ("chat", "code", "prose", "all"):
        assert before[f"{cls}@T0"]["acceptance"] == before[f"{cls}@T0"]["greedy"]
        assert before[f"{cls}@T1"]["acceptance"] != before[f"{cls}@T1"]["greedy"]
        # two sampled continuations a held-out prompt at T = 1 (each may end early at EOS),
        # one greedy: the same prompts at both
        assert before[f"{cls}@T0"]["tokens"] < before[f"{cls}@T1"]["tokens"] <= 2 * before[f"{cls}@T0"]["tokens"]
    n0, n1 = before["all@T0"]["tokens"], before["all@T1"]["tokens"]
    assert before["all"]["acceptance"] == pytest.approx(
        (before["all@T0"]["acceptance"] * n0 + before["all@T1"]["acceptance"] * n1) / (n0 + n1), abs=1e-4)
    assert {"replay@T0", "replay@T1"} <= set(before)           # --replay: trained on, scored too
    assert set(report["guard"]["before"]) == set(before) - {"replay@T0", "replay@T1"}
    assert 3 * 4 * 24 < report["guard"]["before"]["all"]["tokens"] <= 3 * 4 * 3 * 24   # 3 classes x 4 x (1 + 2)
    held = read_prompts(out / "heldout_prompts.jsonl")
    assert {r["class"] for r in held} == {"chat", "code", "prose", "replay"}


def test_replay_prompts_are_lines_of_this_pythons_standard_library():
    """--replay: the draft's own kind of text beside the distilled traffic, the same for a seed."""
    from models.demo_data import source_roots
    from models.distill_prompts import replay_prompts

    rows = replay_prompts(6, seed=2)
    assert rows == replay_prompts(6, seed=2) != replay_prompts(6, seed=3)
    assert len({r["prompt"] for r in rows}) == 6 and {r["class"] for r in rows} == {"replay"}
    stdlib = source_roots(False)[0]
    for r in rows:
        assert 0 < len(r["prompt"]) <= 400
        first = r["prompt"].splitlines(keepends=True)[0]
        assert any(first in f.read_text(encoding="utf-8", errors="replace")
                   for f in stdlib.rglob("*.py") if f.name.endswith(".py")), first


@pytest.mark.parametrize("flag,value", [("--temperature", "-1"), ("--temperature", "0,0"),
                                        ("--temperature", "warm"), ("--validation", "1.5"),
                                        ("--heldout", "-0.1"), ("--eval-every-s", "0"),
                                        ("--replay", "-3"), ("--on-policy", "1.5"),
                                        ("--divergence", "js")])
def test_bad_options_are_refused_before_anything_runs(tiny_family, prompts, tmp_path, flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["draft", "distill", "--target", str(tiny_family["target"]), "--draft",
              str(tiny_family["draft"]), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
              "--steps", "1", flag, value])
    assert exit_.value.code == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kwargs", [{"divergence": "js"}, {"on_policy": 1.5}, {"rollouts": "teacher"},
                                    {"anneal": 2.0}])
def test_an_unknown_objective_is_refused_before_any_model_loads(tmp_path, kwargs):
    from models.distill import DistillData
    from models.distill_train import run_distill

    data = DistillData.from_rows([([1, 2], [3], "code")])
    with pytest.raises(ValueError, match="divergence|on_policy|rollouts|anneal"):
        run_distill(tmp_path / "no-target", tmp_path / "no-draft", data, tmp_path / "out", steps=1, **kwargs)
    assert not (tmp_path / "out").exists()


def test_a_focus_without_a_cap_is_refused_before_anything_runs(tiny_family, prompts, tmp_path,
                                                                capsys):
    """`--focus` only splits `--max-prompts`; alone it would be ignored without a word."""
    code = main(["draft", "distill", "--target", str(tiny_family["target"]), "--draft",
                 str(tiny_family["draft"]), "--prompts", str(prompts), "--out",
                 str(tmp_path / "o"), "--steps", "1", "--focus", "code"])
    assert code == 2 and "--focus needs --max-prompts" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_lone_rank_builds_no_deepspeed_comm_op(tmp_path, monkeypatch):
    """DeepSpeed's backend builds a shared-memory all-reduce op (C++, compiled at first use:
    tens of seconds, minutes on a busy machine) that one rank never calls. A process killed
    mid-build left its lock file behind and the next distillation waited on it for ever (the
    suite hung so). Alone, `init_deepspeed` builds nothing."""
    import torch

    from models.distill import default_ds_config, init_deepspeed

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    model = torch.nn.Linear(4, 4)
    engine, _, _ = init_deepspeed(model, default_ds_config(batch_size=1, zero_stage=0))
    assert engine.module is model
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").iterdir())
