"""`specserve models build-demo`: a tiny-budget build gives a loadable family and its record."""

from __future__ import annotations

import json
import math
import time

import pytest

from cluster.cli import main
from models.demo import DemoSettings, ensure_demo_family
from models.demo_data import is_held_out
from models.loader import load_family

pytestmark = pytest.mark.slow


def test_tiny_build_is_a_loadable_family_and_a_second_call_does_nothing(tmp_path, capsys):
    out = tmp_path / "family"
    argv = ["models", "build-demo", "--out", str(out), "--preset", "tiny",
            "--threads", "1"]
    assert main(argv) == 0

    family = json.loads((out / "family.json").read_text())
    ev = family["eval"]
    vocab = family["vocab_size"]
    for role in ("target", "draft", "small"):
        assert 0 < ev[role]["ce"] < math.log(vocab) + 1, role
    # A draft distilled from the target agrees with it far more often than chance (1 / vocab).
    agreement = ev["draft"]["acceptance_vs_target"]
    assert 10 / vocab < agreement["greedy"] < 1 and 0.1 < agreement["t1"] < 1, agreement
    assert ev["target"]["ce"] < math.log(vocab)         # it learnt something
    assert family["sample"]["greedy"].startswith("def fibonacci(n):")
    assert family["target"]["tokens"] > 0 and family["draft"]["init_layers"] == [0]

    loaded = load_family(out / "target", out / "draft", out / "small")
    for model in (loaded.target, loaded.draft, loaded.small):
        assert type(model.model).__name__ == "LlamaForCausalLM"
        assert model.vocab_size == vocab
        assert model.config.tie_word_embeddings and model.config.max_position_embeddings == 2048
    assert loaded.target.num_params == family["params"]["target"]
    tokenizer = loaded.target.tokenizer
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == tokenizer.pad_token_id == 0
    text = "def f(x):\n        return x  # é\n"
    assert tokenizer.decode(tokenizer(text).input_ids) == text

    weights = out / "target" / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    capsys.readouterr()
    start = time.monotonic()
    assert main(argv) == 0
    assert "up to date" in capsys.readouterr().out
    assert time.monotonic() - start < 15
    assert weights.stat().st_mtime_ns == mtime
    assert ensure_demo_family(out) == out and weights.stat().st_mtime_ns == mtime


def test_settings_hash_and_held_out_split_are_stable():
    assert DemoSettings(seed=1).hash() == DemoSettings(seed=1).hash()
    assert DemoSettings(seed=1).hash() != DemoSettings(seed=2).hash()
    assert DemoSettings(steps_scale=2).hash() != DemoSettings().hash()
    assert [is_held_out(f"pkg/mod{i}.py", 5) for i in range(200)] == \
           [is_held_out(f"pkg/mod{i}.py", 5) for i in range(200)]
    assert 0 < sum(is_held_out(f"pkg/mod{i}.py", 5) for i in range(2000)) < 200


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        DemoSettings(preset="huge")
    with pytest.raises(ValueError):
        DemoSettings(preset="cpu", steps_scale=0)


def test_same_seed_same_tokenizer_and_weights():
    """Deterministic for a seed: the tokenizer, and a run that keeps pace with its planned steps."""
    import torch

    from models.demo_data import CorpusConfig, collect_corpus, encode_files, train_tokenizer
    from models.demo_train import ModelShape, StagePlan, build_model, train

    torch.set_num_threads(1)
    config = CorpusConfig(max_bytes=100_000, tokenizer_bytes=100_000, vocab_size=300)
    corpus = collect_corpus(config)
    tokenizers = [train_tokenizer(corpus.train, config, threads=1) for _ in range(2)]
    assert tokenizers[0].backend_tokenizer.to_str() == tokenizers[1].backend_tokenizer.to_str()
    stream = encode_files(tokenizers[0], corpus.train)
    plan = StagePlan(steps=5, batch_size=2, seq_len=32, lr=3e-3, seed=7)
    weights = []
    for _ in range(2):
        model = build_model(ModelShape(1, 32, 64, head_dim=16), 300, seed=3)
        record = train(model, stream, plan, torch.device("cpu"), desc="determinism")
        assert record["steps"] == 5
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1])


def test_agreement_is_one_for_the_target_itself_and_matches_its_definition(tiny_family):
    """`evaluate`'s agreement: 1 exactly for a copy of the target; for a draft, the mean over
    positions of [argmax q == argmax p] and of sum(min(p, q)), recomputed here by hand."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from models.demo_train import evaluate

    target = AutoModelForCausalLM.from_pretrained(str(tiny_family["target"])).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(tiny_family["draft"])).eval()
    stream = torch.randint(1, target.config.vocab_size, (400,), generator=torch.Generator().manual_seed(0))
    result = evaluate({"target": target, "copy": target, "draft": draft}, stream, 64, 16,
                      torch.device("cpu"))
    assert result["copy"]["acceptance_vs_target"] == {"greedy": 1.0, "t1": 1.0, "t07": 1.0}
    got = result["draft"]["acceptance_vs_target"]
    from models.demo_data import eval_windows

    inputs = eval_windows(stream, 64, 16)[:, :-1]
    with torch.no_grad():
        p, q = target(input_ids=inputs).logits.flatten(0, 1), draft(input_ids=inputs).logits.flatten(0, 1)
    greedy = (p.argmax(-1) == q.argmax(-1)).float().mean().item()
    t1 = torch.minimum(F.softmax(p, -1), F.softmax(q, -1)).sum(-1).mean().item()
    assert got["greedy"] == pytest.approx(greedy, abs=1e-4) and got["t1"] == pytest.approx(t1, abs=1e-4)
    assert got["greedy"] < 1.0 and got["t1"] < 1.0
