"""Automatic prefix caching: which full KV blocks hold which token prefix.

Owns: the chain key of a full block (a hash of its tokens and of the key of the block before
it, so a key names the whole prefix up to the block's end, as vLLM's block hashes do), the map
from keys to the pool's blocks, and the LRU order of kept blocks that no sequence holds. Does
not own: refcounts and allocation (`engine/kv_cache.py: BlockPool`), nor which blocks are
registered and reused (`engine/scheduler.py`, by the rule of
docs/decisions/0028-prefix-caching.md).

Keys are BLAKE2b digests of 16 bytes, so two prefixes share a key only by a collision of a
cryptographic hash (a client cannot craft one to read another's KV); Python's `hash` of a
tuple of ints is not such a hash. The target's and the draft's blocks are keyed in one map under
different roots (`root`): a draft block holds another count of tokens, and its KV is the draft's.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from hashlib import blake2b


def chain_keys(tokens: list[int], block_tokens: int, root: bytes, keys: list[bytes],
               num_blocks: int) -> list[bytes]:
    """Extend `keys` (the keys of the first len(keys) blocks of `tokens`) to the first
    `num_blocks` full blocks of `block_tokens` tokens each; returns `keys`."""
    for j in range(len(keys), num_blocks):
        parent = keys[j - 1] if j else root
        block = array("q", tokens[j * block_tokens:(j + 1) * block_tokens]).tobytes()
        keys.append(blake2b(parent + block, digest_size=16).digest())
    return keys


class PrefixCache:
    """Keys to blocks, and the blocks no sequence holds, least recently used first."""

    def __init__(self):
        self._block: dict[bytes, int] = {}
        self._key: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()   # kept and unheld, oldest first

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a key, held or not."""
        return len(self._key)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The blocks of the longest run of `keys`, from the first, that the cache holds."""
        blocks = []
        for key in keys:
            b = self._block.get(key)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def register(self, block: int, key: bytes) -> None:
        """Key a held block whose KV is complete. A key already kept elsewhere stays with its
        block (this one is then an unkeyed copy, freed as usual)."""
        if key not in self._block and block not in self._key:
            self._block[key], self._key[block] = block, key

    def release(self, block: int) -> bool:
        """The last holder let go: a keyed block joins the LRU end (True); else False."""
        if block in self._key:
            self._lru[block] = None
            return True
        return False

    def hold(self, block: int) -> None:
        """An unheld kept block is held again: out of the LRU list."""
        del self._lru[block]

    def evict(self, n: int) -> list[int]:
        """Drop the keys of the n least recently used unheld blocks; returns those blocks."""
        out = []
        while len(out) < n and self._lru:
            b, _ = self._lru.popitem(last=False)
            del self._block[self._key.pop(b)]
            out.append(b)
        return out
