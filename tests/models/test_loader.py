"""Loading local checkpoints: checks that refuse bad input before anything runs, byte counts."""

import json
import shutil

import pytest
import torch

from models.loader import ModelLoadError, kv_bytes_per_token, load_family, load_model


def test_loads_family_and_counts_bytes(tiny_family):
    fam = load_family(tiny_family["target"], tiny_family["draft"], tiny_family["small"])
    t = fam.target
    # Hand count for the tiny target: vocab 320 (tied head), hidden 64, 2 layers, 4 heads of 16,
    # 2 KV heads, MLP 128: per layer q 64x64, k and v 64x32 each, o 64x64, gate/up/down 3 x 64x128,
    # two norms of 64; plus the embedding 320x64 and the final norm.
    vocab = len(t.tokenizer)
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    params = vocab * 64 + 2 * per_layer + 64
    assert t.num_params == params
    # + the rotary buffers inv_freq and original_inv_freq: head_dim / 2 floats each.
    assert t.weight_bytes - params * 4 == 2 * 8 * 4
    # KV per token: 2 (K, V) x 2 layers x 2 KV heads x 16 head_dim x 4 bytes.
    assert t.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 == 512
    assert kv_bytes_per_token(t.config, torch.bfloat16) == 256
    assert fam.small.kv_bytes_per_token == 2 * 1 * 1 * 16 * 4
    assert t.model.lm_head.weight.data_ptr() == t.model.model.embed_tokens.weight.data_ptr()


def test_missing_and_corrupt_checkpoints(tiny_family, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(empty)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_family["target"], broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_model(broken)
    noweights = tmp_path / "noweights"
    shutil.copytree(tiny_family["target"], noweights)
    (noweights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(noweights)
    badjson = tmp_path / "badjson"
    shutil.copytree(tiny_family["target"], badjson)
    (badjson / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(badjson)


def test_draft_with_another_vocabulary_is_refused(tiny_family, tmp_path):
    import sys

    sys.path.insert(0, str(tiny_family["target"].parent))
    from tiny_models import make_llama, make_tokenizer

    other = tmp_path / "other"
    other.mkdir()
    tok = make_tokenizer(other, vocab_size=300)
    make_llama(other, tok)
    with pytest.raises(ModelLoadError, match="vocabulary size"):
        load_family(tiny_family["target"], other)
    # Same size, different ids: a tokenizer whose tokens are permuted.
    perm = tmp_path / "perm"
    shutil.copytree(tiny_family["draft"], perm)
    data = json.loads((perm / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    keys = sorted(vocab, key=vocab.get)
    vocab[keys[5]], vocab[keys[6]] = vocab[keys[6]], vocab[keys[5]]
    (perm / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="maps tokens to ids differently"):
        load_family(tiny_family["target"], perm)


def test_unknown_dtype_and_missing_device(tiny_family):
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model(tiny_family["target"], dtype="float8")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA device"):
            load_model(tiny_family["target"], device="cuda")
