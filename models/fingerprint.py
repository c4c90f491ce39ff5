"""A cheap digest of a checkpoint folder: what the weights, config and tokenizer are.

Owns: `checkpoint_digest(folder)`, read once when a replica starts and used in the API's
`system_fingerprint`, so a client can tell that two answers came from different models (and
that a seeded request need not reproduce across them). Cheap on any size: the small files
(config, tokenizer) are hashed whole; a weight file contributes its size, its safetensors header
(names, dtypes, shapes, offsets) and SAMPLES evenly spaced 64 KiB slices of its data, so a
retrained checkpoint with the same shapes changes the digest (every slice changes) while a
140 GB model costs 4 MiB of reads. A change confined to bytes no slice touches goes unseen;
that is the price of not reading the whole file. Does not own loading (`models/loader.py`).
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

SAMPLES = 64
SLICE = 64 << 10
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
               "chat_template.jinja")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def _weight_parts(path: Path):
    size = path.stat().st_size
    yield str(size).encode()
    with path.open("rb") as f:
        start = 0
        if path.suffix == ".safetensors" and size >= 8:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header_len = min(header_len, size - 8)
            yield f.read(header_len)
            start = 8 + header_len
        span = max(0, size - start - SLICE)
        offsets = sorted({start + span * i // max(1, SAMPLES - 1) for i in range(SAMPLES)})
        for offset in offsets:
            f.seek(offset)
            yield f.read(SLICE)


def checkpoint_digest(folder: str | Path) -> str:
    """sha256 hex of a checkpoint folder's config, tokenizer and sampled weight bytes."""
    folder = Path(folder)
    h = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        if path.name in SMALL_FILES:
            parts = [path.read_bytes()]
        elif path.suffix in WEIGHT_SUFFIXES:
            parts = _weight_parts(path)
        else:
            continue
        h.update(path.name.encode() + b"\0")
        for part in parts:
            h.update(hashlib.sha256(part).digest())
    return h.hexdigest()
