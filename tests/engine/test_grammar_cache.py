"""Compiled grammars kept on disk (engine/grammar.py: `GrammarCompiler(cache_dir=...)`): a
second engine serves the index a first one compiled, a file that does not load is compiled
again, and an index is kept per regex and vocabulary."""

import pytest
from transformers import AutoTokenizer

from engine.grammar import GrammarCompiler, index_key, token_bytes, vocabulary_key

BOOLEAN, INTEGER = '{"type": "boolean"}', '{"type": "integer"}'


@pytest.fixture(scope="module")
def tokenizer(tiny_family):
    return AutoTokenizer.from_pretrained(str(tiny_family["target"]))


def _first_tokens(grammar) -> list[int]:
    return sorted(grammar.index.get_allowed_tokens(grammar.index.get_initial_state()))


def _kept(folder) -> list:
    return sorted(folder.glob("*.index"))


def test_a_kept_index_is_what_the_next_compiler_serves(tokenizer, tmp_path):
    """The next compiler on the same folder reads the file instead of compiling: swapped for
    another schema's index, the file decides what it serves. Red when the file is not read."""
    eos = tokenizer.eos_token_id
    first = GrammarCompiler(tokenizer, eos, str(tmp_path)).compile(BOOLEAN)
    [path] = _kept(tmp_path)
    again = GrammarCompiler(tokenizer, eos, str(tmp_path)).compile(BOOLEAN)
    assert _first_tokens(again) == _first_tokens(first)
    integer = GrammarCompiler(tokenizer, eos, "").compile(INTEGER)
    assert _first_tokens(integer) != _first_tokens(first)
    path.write_bytes(integer.index.__reduce__()[1][0])
    read = GrammarCompiler(tokenizer, eos, str(tmp_path)).compile(BOOLEAN)
    assert _first_tokens(read) == _first_tokens(integer)


def test_a_kept_index_that_does_not_load_is_compiled_again(tokenizer, tmp_path):
    eos = tokenizer.eos_token_id
    expected = _first_tokens(GrammarCompiler(tokenizer, eos, "").compile(BOOLEAN))
    GrammarCompiler(tokenizer, eos, str(tmp_path)).compile(BOOLEAN)
    [path] = _kept(tmp_path)
    path.write_bytes(b"not an index")
    assert _first_tokens(GrammarCompiler(tokenizer, eos, str(tmp_path)).compile(BOOLEAN)) == expected
    assert _first_tokens(GrammarCompiler(tokenizer, eos, str(tmp_path)).compile(BOOLEAN)) == expected
    assert path.read_bytes() != b"not an index"          # the compiled one replaced it


def test_an_index_is_kept_per_regex_and_vocabulary(tokenizer, tmp_path):
    """Another schema is another file, and the key changes with any token's bytes or ids and
    with eos. Red when the key leaves the vocabulary out (another tokenizer
    would read this one's index)."""
    eos = tokenizer.eos_token_id
    GrammarCompiler(tokenizer, eos, str(tmp_path)).compile(BOOLEAN)
    GrammarCompiler(tokenizer, eos, str(tmp_path)).compile(INTEGER)
    assert len(_kept(tmp_path)) == 2
    tokens = token_bytes(tokenizer)
    key = vocabulary_key(tokens, eos)
    raw = next(iter(tokens))
    assert vocabulary_key({**tokens, raw: [i + 1 for i in tokens[raw]]}, eos) != key
    assert vocabulary_key({**tokens, b"\xff" + raw: tokens[raw]}, eos) != key
    assert vocabulary_key(tokens, eos + 1) != key
    assert index_key("true|false", key) != index_key("true|false", vocabulary_key(tokens, eos + 1))


def test_by_default_indexes_are_kept_under_home_and_empty_keeps_none(tokenizer, tmp_path,
                                                                    monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    eos = tokenizer.eos_token_id
    GrammarCompiler(tokenizer, eos, "").compile(BOOLEAN)
    assert not (tmp_path / ".cache").exists()
    GrammarCompiler(tokenizer, eos).compile(BOOLEAN)
    assert len(_kept(tmp_path / ".cache" / "specserve" / "grammars")) == 1


def test_only_the_most_recently_used_indexes_are_kept(tokenizer, tmp_path, monkeypatch):
    """Callers' schemas are many: past MAX_KEPT_INDEXES files the least recently used goes, and
    reading an index counts as using it. Red without the eviction (three files stay)."""
    import os

    import engine.grammar as grammar

    monkeypatch.setattr(grammar, "MAX_KEPT_INDEXES", 2)
    eos = tokenizer.eos_token_id
    GrammarCompiler(tokenizer, eos, str(tmp_path)).compile(BOOLEAN)
    [boolean] = _kept(tmp_path)
    GrammarCompiler(tokenizer, eos, str(tmp_path)).compile(INTEGER)
    for i, path in enumerate(sorted(_kept(tmp_path), key=lambda p: p != boolean)):
        os.utime(path, (1000 + i, 1000 + i))          # boolean's the older file
    GrammarCompiler(tokenizer, eos, str(tmp_path)).compile(BOOLEAN)   # read: used now
    GrammarCompiler(tokenizer, eos, str(tmp_path)).compile('{"type": "string"}')
    kept = _kept(tmp_path)
    assert len(kept) == 2 and boolean in kept         # the integer index went
