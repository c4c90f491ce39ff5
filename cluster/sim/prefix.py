"""The simulator's prefix cache: which prompt prefixes a replica keeps, counted in tokens.

A prompt names its shareable prefixes (`RequestSpec.prefix`: the system prompt, then the
conversation so far), each a key and a length; a key stands for content, as the engine's
chain keys do (`engine/prefix_cache.py`), so an entry that caches a key's first n tokens serves
any prompt that carries that key, up to the shorter length. An entry counts only the tokens past
its parent's (the system prompt's blocks are held once, however many conversations follow it).

The rules are the engine's: a prompt takes its longest cached run as far as
`kv_rules.reusable_prefix` allows; the full blocks a prompt's prefill computed are cached; an
entry a running sequence holds is never evicted; entries nobody holds count as free memory and
are evicted least recently used first, only when a step needs their memory. One simplification:
entries hold the target's KV only. A speculative sequence's draft reads its whole context in its
first drafting round, as if the draft's blocks were never cached (the engine reuses them where
it has them), so the simulator under-states what caching saves a draft.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine import kv_rules


@dataclass
class Entry:
    tokens: int        # the key's first `tokens` tokens are cached (whole blocks)
    base: int          # of them, the parent's: counted there
    holders: int = 0   # running sequences that hold it


class PrefixCache:
    """Entries by key, least recently used first; token counts of all of them and of the held."""

    def __init__(self, block_tokens: int, unit: int):
        self.block, self.unit = block_tokens, unit
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.tokens = 0        # tokens of KV the entries hold
        self.held_tokens = 0   # ... of entries some running sequence holds
        self.queries = self.hits = 0   # prompt tokens looked up, and found

    def _run(self, prefix) -> tuple[int, list[str]]:
        """The longest cached run from the prompt's start, and the keys that hold it."""
        run, keys = 0, []
        for key, length in prefix:
            entry = self.entries.get(key)
            if entry is None or entry.base != run:
                break
            keys.append(key)
            run = entry.tokens
            if entry.tokens < length // self.block * self.block:
                break
        return run, keys

    def lookup(self, prefix, prompt_tokens: int) -> tuple[int, list[str], int]:
        """(tokens the prompt takes from the cache, the keys that hold them, tokens of those
        that no sequence holds yet: holding them takes them out of the free memory)."""
        run, keys = self._run(prefix)
        hit = kv_rules.reusable_prefix(prompt_tokens, run, self.unit)
        keys = [k for k in keys if self.entries[k].base < hit]
        unheld = sum(min(e.tokens, hit) - e.base for e in map(self.entries.get, keys)
                     if not e.holders)
        return hit, keys, unheld

    def hold(self, keys: list[str], prompt_tokens: int, hit: int) -> None:
        for key in keys:
            entry = self.entries[key]
            if not entry.holders:
                self.held_tokens += entry.tokens - entry.base
            entry.holders += 1
            self.entries.move_to_end(key)
        self.queries += prompt_tokens
        self.hits += hit

    def release(self, keys: list[str]) -> None:
        for key in keys:
            entry = self.entries[key]
            entry.holders -= 1
            if not entry.holders:
                self.held_tokens -= entry.tokens - entry.base
            self.entries.move_to_end(key)

    def insert(self, prefix, prompt_tokens: int, held: list[str]) -> tuple[int, list[str]]:
        """Cache the full blocks of a prompt whose prefill is done (the sequence holding
        `held`); returns the tokens moved from the sequence's own KV into entries, and the keys
        it holds now."""
        moved, keys, base = 0, list(held), 0
        for key, length in prefix:
            end = min(length, prompt_tokens) // self.block * self.block
            if end <= base:
                break
            entry = self.entries.get(key)
            if entry is None:
                entry = self.entries[key] = Entry(base, base)
            elif entry.base != base:
                break
            if key not in keys:
                if not entry.holders:
                    self.held_tokens += entry.tokens - entry.base
                entry.holders += 1
                keys.append(key)
            if entry.tokens < end:
                moved += end - entry.tokens
                self.tokens += end - entry.tokens
                self.held_tokens += end - entry.tokens
                entry.tokens = end
            self.entries.move_to_end(key)
            base = end
        return moved, keys

    def evict(self) -> int:
        """Drop the least recently used entry nobody holds; returns its tokens (0: none)."""
        for key, entry in self.entries.items():
            if not entry.holders:
                del self.entries[key]
                self.tokens -= entry.tokens - entry.base
                return entry.tokens - entry.base
        return 0
