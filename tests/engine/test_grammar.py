"""JSON output under a grammar, in plain and speculative decoding.

With tiny random models the text is garbage, but it must match the schema: the mask applies to
the draft's proposals and to the target's verify rows alike (engine/logits_processors.py).
"""

import json
import random

import jsonschema
import pytest
from transformers import AutoTokenizer

from conftest import run_all
from engine.errors import InvalidParamError
from engine.grammar import JSON_OBJECT_SCHEMA, token_bytes
from engine.sampling_params import FinishReason, RequestOptions, SamplingParams

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer"},
                         "ok": {"type": "boolean"},
                         "kind": {"enum": ["cat", "dog", "fish"]}},
          "required": ["name", "age", "ok", "kind"]}
PROMPTS = [[5 + i, 7, 9 + 2 * i, 11] * (1 + i % 3) for i in range(10)]


def _text(outs):
    return {rid: "".join(o.text for o in chunks) for rid, chunks in outs.items()}


def _run(engine, arrivals):
    """run_all that keeps each request's outputs (for their text)."""
    chunks, step = {}, 0
    while engine.has_unfinished() or arrivals:
        for args in arrivals.pop(step, []):
            engine.add_request(*args)
        for o in engine.step():
            chunks.setdefault(o.request_id, []).append(o)
        step += 1
    return chunks


def test_token_bytes_match_the_tokenizer(tiny_family):
    """Every token's bytes, decoded, are the tokenizer's own decoding of it."""
    tok = AutoTokenizer.from_pretrained(str(tiny_family["target"]))
    table = token_bytes(tok)
    assert sum(len(ids) for ids in table.values()) == len(tok) - len(tok.all_special_ids)
    for raw, ids in table.items():
        text = raw.decode("utf-8", errors="replace")
        if "\ufffd" not in text:
            assert tok.decode(ids) == text


def test_a_hundred_sampled_requests_all_match_the_schema(make_engine):
    """100 requests at T = 1, half speculative, a third with ignore_eos: every one ends with
    `stop` and its text parses and validates. Red when the target's verify rows are not masked,
    when a verify row's grammar state ignores the drafts before it, or when a complete grammar
    does not end the request."""
    engine = make_engine(adaptive_k=False, max_num_seqs=32, max_waiting=200)
    rng, arrivals = random.Random(0), {}
    for i in range(100):
        params = SamplingParams(temperature=1.0, max_tokens=200, json_schema=json.dumps(SCHEMA),
                                ignore_eos=i % 3 == 0)     # the grammar's end stops it anyway
        opts = RequestOptions("speculative" if i % 2 else "baseline", k_max=1 + i % 4)
        arrivals.setdefault(rng.randrange(10), []).append((f"r{i}", PROMPTS[i % 10], params, opts))
    chunks = _run(engine, arrivals)
    snap = engine.snapshot()
    assert 0 < snap.num_accepted_tokens < snap.num_draft_tokens
    eos = set(engine.target_model.eos_token_ids)
    for rid, text in _text(chunks).items():
        assert chunks[rid][-1].finish_reason == FinishReason.STOP, (rid, text)
        jsonschema.validate(json.loads(text), SCHEMA)
        # the closing brace ends it: nothing may follow, so no step is spent sampling eos
        assert not eos & {t for o in chunks[rid] for t in o.token_ids}


def test_greedy_speculative_equals_plain_decoding_under_the_grammar(make_engine, tiny_family):
    """Token for token, and the target as its own draft has every draft accepted (red when
    the draft's mask uses the wrong grammar state)."""
    schema = json.dumps(SCHEMA)
    params = SamplingParams(temperature=0.0, max_tokens=40, json_schema=schema,
                            frequency_penalty=0.5)
    plain = []
    for p in PROMPTS[:5]:
        engine = make_engine(draft=False)
        engine.add_request("p", p, params)
        plain.append(run_all(engine)[0]["p"])
    engine = make_engine(adaptive_k=False)
    for i, p in enumerate(PROMPTS[:5]):
        engine.add_request(f"r{i}", p, params, RequestOptions("speculative", k_max=1 + i % 4))
    outs, _ = run_all(engine)
    assert [outs[f"r{i}"] for i in range(5)] == plain
    assert engine.snapshot().num_accepted_tokens > 0
    own = make_engine(draft=tiny_family["target"], adaptive_k=False)
    for i, p in enumerate(PROMPTS[:5]):
        own.add_request(f"r{i}", p, params, RequestOptions("speculative", k_max=4))
    outs, _ = run_all(own)
    assert [outs[f"r{i}"] for i in range(5)] == plain
    snap = own.snapshot()
    assert snap.num_draft_tokens > 20 and snap.num_accepted_tokens == snap.num_draft_tokens


def test_json_object_output_is_an_object(make_engine):
    engine = make_engine(adaptive_k=False)
    params = SamplingParams(temperature=1.0, max_tokens=120, json_schema=JSON_OBJECT_SCHEMA)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params, RequestOptions("speculative", k_max=3))
    chunks = _run(engine, {})
    done = 0
    for rid, text in _text(chunks).items():
        assert text.startswith("{")
        if chunks[rid][-1].finish_reason == FinishReason.STOP:
            assert isinstance(json.loads(text), dict)
            done += 1
    assert done >= 5


@pytest.mark.parametrize("schema", ['{"type": "nonsense"}', "not json", '{"type": "object"'])
def test_a_schema_that_does_not_compile_is_refused(make_engine, schema):
    engine = make_engine(draft=False)
    with pytest.raises(InvalidParamError) as err:
        engine.add_request("r", [1, 2], SamplingParams(json_schema=schema))
    assert err.value.param == "response_format"
    assert not engine.has_unfinished()


def test_a_schema_compiles_while_other_requests_step(make_engine):
    """`json_object` takes seconds to compile: the engine steps its other requests meanwhile and
    schedules the request once its grammar is ready; one aborted while compiling never runs.
    Red when the compile runs in `add_request` (the first step would find the request
    scheduled), or when an aborted request is scheduled once its grammar is ready. The engine
    keeps no compiled grammar on disk here, so its compile is a real one."""
    engine = make_engine(adaptive_k=False, grammar_cache_dir="")
    scheduled, add = [], engine.scheduler.add
    engine.scheduler.add = lambda seq: (scheduled.append(seq.request_id), add(seq))
    engine.add_request("plain", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8,
                                                           ignore_eos=True))
    params = SamplingParams(temperature=1.0, max_tokens=60, json_schema=JSON_OBJECT_SCHEMA)
    engine.add_request("json", PROMPTS[1], params, RequestOptions("speculative", k_max=3))
    engine.add_request("gone", PROMPTS[2], params)
    first = {o.request_id: o for o in engine.step()}
    assert first["plain"].token_ids and "json" not in first
    assert engine.seqs["json"] not in [*engine.scheduler.waiting, *engine.scheduler.running]
    assert engine.abort("gone").finish_reason == FinishReason.ABORT
    chunks = _run(engine, {})
    assert len(chunks["plain"]) == 7 and chunks["json"][-1].finished
    assert "".join(o.text for o in chunks["json"]).startswith("{")
    assert "gone" not in chunks and not engine.has_unfinished() and not engine.processors.compiling
    assert scheduled == ["plain", "json"]                        # "gone" never ran


def test_a_schema_no_token_sequence_can_write_is_refused_not_failed(tmp_path):
    """A model whose vocabulary cannot spell JSON (a word-level tokenizer of letters only):
    `json_object` passes the schema's check and fails only when its index is built, on the
    compile thread. The request then ends as a refusal naming `response_format` (a 400), not as
    an engine failure (a 503 a client would retry)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from tiny_models import make_llama

    words = ["<eos>"] + [a + b for a in "abcdefgh" for b in "abcdefgh"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<eos>")
    make_llama(tmp_path, fast, layers=1, hidden=32, heads=2, kv_heads=1, mlp=64)
    engine = AsyncEngine(EngineConfig(str(tmp_path), None, kv_budget_bytes=1 << 20,
                                      profile=False, num_threads=1, dtype="float32"))

    async def run():
        params = SamplingParams(max_tokens=4, json_schema=JSON_OBJECT_SCHEMA)
        return [o async for o in engine.generate("r", [1, 2, 3], params, RequestOptions())]

    import asyncio
    try:
        with pytest.raises(InvalidParamError) as err:
            asyncio.run(run())
        assert err.value.param == "response_format" and "compiled" in str(err.value)
        assert engine.metrics().num_failed_steps == 0
    finally:
        engine.shutdown()
