"""Tiny random Hugging Face checkpoints, made on the fly for tests (no downloads).

`make_family(root)` writes a shared byte-level BPE tokenizer and three `LlamaForCausalLM`
folders: a target (grouped-query attention), a draft made from the target's weights plus noise
(so it agrees often but not always, like a distilled draft), and a small model.
`make_odd_draft(folder, target_folder)` adds a draft whose KV shape differs from the target's
(more layers, a wider head), as a 7B draft's differs from a 70B target's.
"""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
        "        self.x = x\n        self.y = y\n\nfor i in range(10):\n    print(i * i)\n"
        "import os\nimport sys\nwhile True:\n    break\n# the quick brown fox jumps over the lazy dog\n")


def make_tokenizer(folder: Path, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(folder))
    return fast


def make_llama(folder: Path, tokenizer, layers=2, hidden=64, heads=4, kv_heads=2, mlp=128,
               seed=0, base=None, noise=0.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=mlp,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=512,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():     # larger weights: peakier, more decisive distributions
            p.mul_(4.0) if p.dim() > 1 else None
        if base is not None:
            for p, q in zip(model.parameters(), base.parameters()):
                p.copy_(q + noise * torch.randn_like(q) * q.std())
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return model


def make_family(root: Path) -> dict[str, Path]:
    root = Path(root)
    paths = {role: root / role for role in ("target", "draft", "small")}
    for p in paths.values():
        p.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(paths["target"])
    target = make_llama(paths["target"], tokenizer, seed=0)
    make_llama(paths["draft"], tokenizer, seed=1, base=target, noise=0.15)
    make_llama(paths["small"], tokenizer, layers=1, hidden=32, heads=2, kv_heads=1, mlp=64, seed=2)
    return paths


def make_odd_draft(folder: Path, target_folder: Path) -> Path:
    """A draft with its own random weights and another KV shape: 3 layers, head_dim 24 (the
    target has 2 layers, head_dim 16), sharing the target's tokenizer. Its KV per token is not a
    divisor of the target's, so a pool holding both uses more tokens per block than block_size."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(target_folder))
    make_llama(folder, tokenizer, layers=3, hidden=96, heads=4, kv_heads=2, mlp=96, seed=3)
    return folder


def make_sharded_llama(folder: Path, tokenizer_folder: Path, layers: int = 24, hidden: int = 512,
                       heads: int = 32, kv_heads: int = 4, mlp: int = 1792, shards: int = 3,
                       seed: int = 0) -> int:
    """A random bf16 Llama checkpoint with 70B's proportions (8 query heads per KV head, MLP
    3.5x hidden, an untied head), written tensor by tensor as `shards` safetensors files and
    their index (models/synthetic.py), with the tiny family's tokenizer. Returns its bytes."""
    from transformers import AutoTokenizer

    from models.synthetic import write_random_llama

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    total = write_random_llama(folder, layers, hidden, heads, kv_heads, mlp, len(tokenizer),
                               shards, seed, max_position=512)
    tokenizer.save_pretrained(str(folder))
    return total
