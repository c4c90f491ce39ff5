"""Random Llama checkpoints of any shape, written as large checkpoints are: several safetensors
files and their index, one tensor at a time (the writer never holds the model).

Owns: writing a folder that `models.loader` serves, for tests and for benchmarks of loading at
shapes no one can download here (a 70B model's widths, one or two layers). Not a model family
to serve: the weights are noise, scaled so activations stay bounded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def layer_shapes(i: int, hidden: int, heads: int, kv_heads: int, mlp: int,
                 head_dim: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}."
    return {p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (mlp, hidden),
            p + "mlp.up_proj.weight": (mlp, hidden),
            p + "mlp.down_proj.weight": (hidden, mlp),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,)}


def write_random_llama(folder: str | Path, layers: int, hidden: int, heads: int, kv_heads: int,
                       mlp: int, vocab: int, shards: int = 2, seed: int = 0,
                       dtype: torch.dtype = torch.bfloat16, max_position: int = 4096) -> int:
    """Write config.json, `shards` safetensors files and their index into `folder` (an untied
    head, as 70B's). Returns the weights' bytes."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                max_position_embeddings=max_position, bos_token_id=0, eos_token_id=0,
                pad_token_id=0, tie_word_embeddings=False,
                torch_dtype=str(dtype).removeprefix("torch.")).save_pretrained(str(folder))
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update(layer_shapes(i, hidden, heads, kv_heads, mlp, hidden // heads))
    names = list(shapes)
    g = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    element = torch.empty((), dtype=dtype).element_size()
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {}
        for name in names[s::shards]:
            shape = shapes[name]
            if len(shape) == 1:                                 # norms: near 1
                t = 1 + 0.1 * torch.randn(shape, generator=g)
            else:                                               # unit-variance outputs
                t = torch.randn(shape, generator=g).mul_(2 * shape[1] ** -0.5)
            part[name] = t.to(dtype)
            del t
            weight_map[name] = file
            total += part[name].numel() * element
        save_file(part, str(folder / file), metadata={"format": "pt"})
        del part
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total
