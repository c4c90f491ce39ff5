"""The demo family's data: a Python-source corpus, its byte-level BPE tokenizer, token streams.

Owns: choosing the corpus files (the Python sources of the standard library and, optionally, the
installed packages: text that is on every fresh machine), the deterministic split of whole files into
training and held-out sets, training the tokenizer, and turning files into flat token streams with
`<|endoftext|>` (id 0) between files. Does not own: models, training or evaluation (`models/demo_train.py`).

Everything here is a pure function of its arguments and the files on disk: sorted paths, a hash of
each relative path for the split, no randomness, so a seed and the same Python give the same data.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

EOT = "<|endoftext|>"     # bos, eos and pad; id 0
SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages",
             "encodings"}   # encodings: codec tables, 14% of the standard library and no code


@dataclass(frozen=True)
class CorpusConfig:
    max_bytes: int                  # stop adding files once the corpus holds this many bytes
    site_packages: bool = False     # add installed packages after the standard library
    max_file_bytes: int = 200_000   # skip generated or vendored giants
    held_out_percent: int = 5       # share of files (by path hash) held out for evaluation
    tokenizer_bytes: int = 4_000_000  # the tokenizer trains on the first this-many training bytes
    vocab_size: int = 4096

    def __post_init__(self):
        if not 0 < self.held_out_percent < 50:
            raise ValueError("held_out_percent must be in (0, 50)")
        if self.vocab_size < 300:
            raise ValueError("vocab_size must exceed the 256 byte tokens plus merges")


@dataclass
class Corpus:
    train: list[str]        # file texts, in sorted-path order
    held_out: list[str]
    train_bytes: int
    held_out_bytes: int
    roots: list[str]


def source_roots(site_packages: bool) -> list[Path]:
    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"])]
    if site_packages:
        roots += sorted({Path(paths["purelib"]), Path(paths["platlib"])})
    return roots


def is_held_out(relative_path: str, percent: int) -> bool:
    """A stable split: a file is held out by the hash of its path, whatever else changes."""
    digest = hashlib.sha1(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < percent


def _python_files(root: Path, max_file_bytes: int):
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if SKIP_DIRS.intersection(relative.parts[:-1]) or not path.is_file():
            continue
        if path.stat().st_size > max_file_bytes:
            continue
        yield relative.as_posix(), path


def collect_corpus(config: CorpusConfig) -> Corpus:
    """Read Python files in sorted order until `max_bytes`; split whole files by path hash."""
    corpus = Corpus(train=[], held_out=[], train_bytes=0, held_out_bytes=0, roots=[])
    for root in source_roots(config.site_packages):
        if not root.is_dir():
            continue
        corpus.roots.append(str(root))
        for relative, path in _python_files(root, config.max_file_bytes):
            if corpus.train_bytes + corpus.held_out_bytes >= config.max_bytes:
                return corpus
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            if is_held_out(relative, config.held_out_percent):
                corpus.held_out.append(text)
                corpus.held_out_bytes += len(text)
            else:
                corpus.train.append(text)
                corpus.train_bytes += len(text)
    return corpus


def train_tokenizer(texts: list[str], config: CorpusConfig, threads: int):
    """Train a byte-level BPE (GPT-2 style pre-tokenizer); `<|endoftext|>` is id 0.

    Returns a `PreTrainedTokenizerFast` whose `save_pretrained` folder `AutoTokenizer` loads.
    """
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sample, size = [], 0
    for text in texts:
        if size >= config.tokenizer_bytes:
            break
        sample.append(text)
        size += len(text)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=config.vocab_size, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tokenizer.train_from_iterator(sample, trainer=trainer, length=len(sample))
    if tokenizer.token_to_id(EOT) != 0:
        raise RuntimeError(f"{EOT} must be id 0, got {tokenizer.token_to_id(EOT)}")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOT, eos_token=EOT,
                                   pad_token=EOT, unk_token=EOT, model_max_length=2048)


def encode_files(tokenizer, texts: list[str]) -> torch.Tensor:
    """One flat stream `[num_tokens]` (int32): each file's tokens followed by EOT (id 0)."""
    backend = tokenizer.backend_tokenizer
    ids: list[int] = []
    for start in range(0, len(texts), 256):
        for encoding in backend.encode_batch(texts[start:start + 256], add_special_tokens=False):
            ids.extend(encoding.ids)
            ids.append(0)
    return torch.tensor(ids, dtype=torch.int32)


def sample_windows(stream: torch.Tensor, batch_size: int, seq_len: int,
                   generator: torch.Generator) -> torch.Tensor:
    """Random windows `[batch_size, seq_len + 1]` (int64) of the stream: inputs and shifted labels."""
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    return stream[starts[:, None] + offsets[None, :]].long()


def eval_windows(stream: torch.Tensor, num_tokens: int, seq_len: int) -> torch.Tensor:
    """Evenly spaced windows `[num_windows, seq_len + 1]` covering the held-out stream."""
    num_windows = max(1, min(num_tokens // seq_len, (len(stream) - 1) // (seq_len + 1)))
    span = len(stream) - seq_len - 1
    if span < 0:
        raise ValueError(f"held-out stream has {len(stream)} tokens, fewer than {seq_len + 1}")
    starts = torch.linspace(0, span, num_windows).long()
    offsets = torch.arange(seq_len + 1)
    return stream[starts[:, None] + offsets[None, :]].long()
