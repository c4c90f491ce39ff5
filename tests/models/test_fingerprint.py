"""The checkpoint digest behind `system_fingerprint`: stable, and it changes with the weights,
the config or the tokenizer, and with the numerics a replica runs."""

import json
import shutil


from deployments.engine_server import EngineServer
from models.fingerprint import checkpoint_digest


def test_digest_is_stable_and_tells_models_apart(tiny_family):
    target = checkpoint_digest(tiny_family["target"])
    assert target == checkpoint_digest(tiny_family["target"])
    assert len({target, checkpoint_digest(tiny_family["draft"]),
                checkpoint_digest(tiny_family["small"])}) == 3


def test_digest_changes_with_weights_config_and_tokenizer(tiny_family, tmp_path):
    from safetensors.torch import load_file, save_file

    base = checkpoint_digest(tiny_family["target"])
    copy = shutil.copytree(tiny_family["target"], tmp_path / "t")
    assert checkpoint_digest(copy) == base                     # the path does not matter
    weights = copy / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[-1]
    tensors[name] = tensors[name] * 1.01                       # retrained: same shapes, new values
    save_file(tensors, weights, metadata={"format": "pt"})
    retrained = checkpoint_digest(copy)
    assert retrained != base
    config = json.loads((copy / "config.json").read_text())
    config["rope_theta"] = 1234.0
    (copy / "config.json").write_text(json.dumps(config))
    assert checkpoint_digest(copy) != retrained
    before = checkpoint_digest(copy)
    (copy / "tokenizer_config.json").write_text((copy / "tokenizer_config.json").read_text() + " ")
    assert checkpoint_digest(copy) != before


def test_replica_fingerprint_covers_numerics(tiny_family):
    from router.config import TierModelConfig

    tier = TierModelConfig(model=str(tiny_family["target"]), dtype="float32", device="cpu")
    fp = EngineServer.replica_fingerprint(tier)
    assert fp == EngineServer.replica_fingerprint(tier.model_copy())
    assert fp != EngineServer.replica_fingerprint(tier.model_copy(update={"dtype": "bfloat16"}))
    assert fp != EngineServer.replica_fingerprint(tier.model_copy(update={"tp_size": 2}))
    assert fp != EngineServer.replica_fingerprint(tier.model_copy(update={"model": str(tiny_family["small"])}))
    # The draft is not part of it: the samplers are exact, a draft changes speed only.
    assert fp == EngineServer.replica_fingerprint(tier.model_copy(update={"draft": str(tiny_family["draft"])}))
