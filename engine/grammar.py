"""JSON output under a grammar: a JSON schema compiled to a token-level automaton (outlines-core).

Owns: the served tokenizer's vocabulary as bytes (the form outlines-core matches against), the
compiled automata (`Grammar`, cached per schema text), and a state's allowed tokens as an index
tensor. Does not own where the mask is applied (`engine/logits_processors.py`) nor the schema's
wire shape (`router/openai_schema.py`).

outlines-core's `Index` is a stateless map (state, token) -> state, so a state is a plain int:
the state at draft position j is the sequence's state advanced through the j tokens drafted
before it, and a rejection needs no rollback (the sequence's state only ever advances through
emitted tokens). Why outlines-core: docs/decisions/0027-grammar-library.md.

Compiled indexes are also kept on disk (`cache_dir`, by default ~/.cache/specserve/grammars),
one file per regex and vocabulary, in outlines-core's own binary form: `json_object` takes
seconds to compile, and every engine process that serves it would compile it again at its
first such request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# response_format {"type": "json_object"}: any JSON object (nesting up to the library's default
# recursion depth of 3).
JSON_OBJECT_SCHEMA = '{"type": "object"}'
MAX_CACHED_GRAMMARS = 32
MAX_CACHED_IDS = 1 << 24      # allowed token ids kept per grammar, all states together (64 MB)
INDEX_FORMAT = 1              # part of a kept index's key: a new layout never reads an old file
MAX_KEPT_INDEXES = 64         # files kept on disk; the least recently used go first (callers'
                              # schemas are many, and each would otherwise stay for good)


class GrammarError(ValueError):
    """A schema the library cannot compile (an unsupported keyword, invalid JSON)."""


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards: the printable character that stands for each byte
    in a byte-level BPE token string -> that byte."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(tokenizer) -> dict[bytes, list[int]]:
    """Each non-special token's bytes -> its ids. Byte-level BPE tokens map through GPT-2's byte
    alphabet; SentencePiece tokens turn '▁' into a space and `<0xNN>` into byte NN."""
    special = set(tokenizer.all_special_ids)
    decoder = _byte_decoder()
    vocab = tokenizer.get_vocab()
    byte_level = all(c in decoder for t in vocab for c in t if t and vocab[t] not in special)
    out: dict[bytes, list[int]] = {}
    for text, token_id in vocab.items():
        if token_id in special or not text:
            continue
        if byte_level:
            raw = bytes(decoder[c] for c in text)
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            raw = bytes([int(text[3:5], 16)])
        else:
            raw = text.replace("\u2581", " ").encode()
        out.setdefault(raw, []).append(token_id)
    return out


class Grammar:
    """One compiled schema. States are ints; `None` is a dead state (no valid continuation)."""

    def __init__(self, index, eos_token_id: int):
        self.index = index
        self.eos_token_id = eos_token_id
        self._masks: OrderedDict[int, torch.Tensor] = OrderedDict()   # state -> allowed ids
        self._cached_ids = 0
        self._lock = threading.Lock()

    @property
    def initial_state(self) -> int:
        return self.index.get_initial_state()

    def advance(self, state: int | None, token: int) -> int | None:
        if state is None or token == self.eos_token_id:
            return None
        return self.index.get_next_state(state, token)

    def allowed(self, state: int | None, device) -> torch.Tensor:
        """[n] long: the tokens allowed in `state` (a dead state allows eos only, so a row is
        never all -inf)."""
        key = -1 if state is None else state
        with self._lock:
            ids = self._masks.get(key)
            if ids is None:
                tokens = ([self.eos_token_id] if state is None
                          else self.index.get_allowed_tokens(state))
                ids = torch.tensor(tokens, dtype=torch.int32)
                self._masks[key] = ids
                self._cached_ids += len(ids)
                while self._cached_ids > MAX_CACHED_IDS and len(self._masks) > 1:   # LRU first
                    self._cached_ids -= len(self._masks.popitem(last=False)[1])
            self._masks.move_to_end(key)
        return ids.to(device=device, dtype=torch.long)

    def complete(self, state: int | None) -> bool:
        """The text so far is a whole match and nothing but eos may follow."""
        if state is None or not self.index.is_final_state(state):
            return False
        return self.index.get_allowed_tokens(state) == [self.eos_token_id]


class GrammarCompiler:
    """Compiles schemas against one tokenizer; grammars are cached by schema text.

    The regex is built in the caller's thread (fast, and where a schema the library refuses is
    caught), the index on one worker thread: it takes seconds for a loose schema and
    outlines-core releases the GIL meanwhile, so the engine's step loop runs on.
    """

    def __init__(self, tokenizer, eos_token_id: int, cache_dir: str | None = None):
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.cache_dir = index_dir(cache_dir)
        self._vocabulary = None
        self._vocabulary_key = ""
        self._cache: OrderedDict[str, Grammar | Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def compile(self, schema: str) -> Grammar:
        """The grammar of `schema`, waiting for its compile."""
        found = self.compile_later(schema)
        return found if isinstance(found, Grammar) else found.result()

    def compile_later(self, schema: str) -> Grammar | Future:
        """The cached grammar, or a Future of it. Raises GrammarError at once for a schema the
        library refuses."""
        with self._lock:
            found = self._cache.get(schema)
            if found is not None:
                self._cache.move_to_end(schema)
                return found
        regex = self._regex(schema)
        with self._lock:
            found = self._cache.get(schema)
            if found is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
                found = self._cache[schema] = self._pool.submit(self._build, schema, regex)
                if len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
            return found

    @staticmethod
    def _regex(schema: str) -> str:
        from outlines_core.json_schema import build_regex_from_schema

        try:
            json.loads(schema)
            return build_regex_from_schema(schema)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the JSON schema cannot be compiled: {exc}") from None

    def _build(self, schema: str, regex: str) -> Grammar:
        from outlines_core import Index, Vocabulary

        if self._vocabulary is None:        # only this worker thread builds indexes
            tokens = token_bytes(self.tokenizer)
            self._vocabulary = Vocabulary(self.eos_token_id, tokens)
            self._vocabulary_key = vocabulary_key(tokens, self.eos_token_id)
        path = (self.cache_dir / f"{index_key(regex, self._vocabulary_key)}.index"
                if self.cache_dir is not None else None)
        index = _read_index(path) if path is not None else None
        if index is None:
            try:
                index = Index(regex, self._vocabulary)
            except (ValueError, TypeError) as exc:     # e.g. no token sequence can match
                raise GrammarError(f"the JSON schema cannot be compiled: {exc}") from None
            if path is not None:
                _write_index(path, index)
        grammar = Grammar(index, self.eos_token_id)
        with self._lock:
            if schema in self._cache:       # the grammar itself from now on, not its Future
                self._cache[schema] = grammar
        return grammar


def index_dir(setting: str | None) -> Path | None:
    """Where compiled indexes are kept: `setting` (EngineConfig.grammar_cache_dir), by default
    ~/.cache/specserve/grammars; "" keeps none."""
    if setting == "":
        return None
    return Path(setting) if setting else Path.home() / ".cache" / "specserve" / "grammars"


def vocabulary_key(tokens: dict[bytes, list[int]], eos_token_id: int) -> str:
    """What an index depends on besides its regex: every token's bytes and ids, and eos."""
    digest = hashlib.sha256(str(eos_token_id).encode())
    for raw, ids in sorted(tokens.items()):
        digest.update(len(raw).to_bytes(4, "little") + raw + str(sorted(ids)).encode())
    return digest.hexdigest()


def index_key(regex: str, vocabulary: str) -> str:
    from importlib.metadata import version

    parts = [str(INDEX_FORMAT), version("outlines-core"), vocabulary, regex]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _read_index(path: Path):
    """The index kept at `path`, or None (none kept, or one that does not load: rebuilt)."""
    from outlines_core import Index

    try:
        index = Index.from_binary(path.read_bytes())
        os.utime(path)                  # used now: the last to be evicted (`_write_index`)
        return index
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        logger.warning("compiled grammar %s does not load (%s); compiling it again", path, exc)
        return None


def _write_index(path: Path, index) -> None:
    """Keep `index` at `path`, whole or not at all (another engine may read it meanwhile)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = index.__reduce__()[1][0]        # outlines-core's binary form (`from_binary`)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
        kept = sorted(path.parent.glob("*.index"), key=_mtime)
        for old in kept[:max(0, len(kept) - MAX_KEPT_INDEXES)]:
            old.unlink(missing_ok=True)
    except OSError as exc:         # a read-only home: the engine serves on, compiling each time
        logger.warning("could not keep the compiled grammar at %s: %s", path, exc)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:                 # removed by another engine meanwhile
        return 0.0
