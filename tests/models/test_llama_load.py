"""What `LlamaForward.load` takes from a config without building transformers' model: the
tensors it needs and the rotary frequencies, each held to transformers' own model; and the
checkpoints it refuses because of them."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.llama import needed_tensors, rope_frequencies
from models.loader import ModelLoadError, load_served

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _config(kind: str, **extra):
    from transformers import AutoConfig

    return AutoConfig.for_model(kind, **SHAPE, **extra)


def _skeleton(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("kind,extra", [
    ("llama", {}), ("llama", {"attention_bias": True}), ("llama", {"tie_word_embeddings": True}),
    ("mistral", {}), ("qwen2", {}), ("qwen2", {"tie_word_embeddings": True})])
def test_the_tensors_needed_are_the_parameters_transformers_builds(kind, extra):
    config = _config(kind, **extra)
    built = {name for name, _ in _skeleton(config).named_parameters()}
    if getattr(config, "tie_word_embeddings", False):
        built.discard("lm_head.weight")
    assert needed_tensors(config) == built


@pytest.mark.parametrize("rope", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64}])
def test_rope_frequencies_are_the_rotary_module_s(rope):
    extra = {} if rope is None else {"rope_parameters": {"rope_theta": 500000.0, **rope}}
    config = _config("llama", **extra)
    rotary = type(_skeleton(config).model.rotary_emb)(config=config)
    inv_freq, scaling = rope_frequencies(config)
    torch.testing.assert_close(inv_freq, rotary.inv_freq.float(), rtol=0, atol=0)
    assert scaling == pytest.approx(float(rotary.attention_scaling))


def _edit(src, dst, config_changes=None, drop=()):
    shutil.copytree(src, dst)
    if config_changes:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config_changes)
        (dst / "config.json").write_text(json.dumps(cfg))
    if drop:
        tensors = load_file(dst / "model.safetensors")
        save_file({k: v for k, v in tensors.items() if k not in drop}, dst / "model.safetensors",
                  metadata={"format": "pt"})
    return dst


def test_a_checkpoint_without_a_tensor_the_config_needs_is_refused_by_name(tiny_family, tmp_path):
    load_served(tiny_family["target"])            # the unedited checkpoint loads
    name = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(ModelLoadError, match="lacks 1 tensors.*layers.1.mlp.up_proj"):
        load_served(_edit(tiny_family["target"], tmp_path / "dropped", drop={name}))
    # a config that asks for attention biases the weights do not have: never served without them
    with pytest.raises(ModelLoadError, match=r"lacks 8 tensors.*self_attn.k_proj.bias"):
        load_served(_edit(tiny_family["target"], tmp_path / "biased",
                          config_changes={"attention_bias": True}))


def test_mlp_biases_are_refused_since_the_forward_does_not_add_them(tiny_family, tmp_path):
    with pytest.raises(ValueError, match="unsupported: MLP biases"):
        load_served(_edit(tiny_family["target"], tmp_path / "edited",
                          config_changes={"mlp_bias": True}))
