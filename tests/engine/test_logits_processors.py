"""Penalties and logit bias: the formulas, and exactness under speculation.

The processing changes the target's distribution, so the draft's rows must get the same
processing, position by position (engine/logits_processors.py). Greedy speculative output must
equal plain decoding with the same processing; sampled output must follow the processed target
distribution; the target as its own draft must have every draft accepted.
"""

import json
import random

import pytest
import torch

from conftest import run_all, three_token_pvalue
from engine.errors import InvalidParamError
from engine.logits_processors import RequestProcessor, process
from engine.sampling_params import RequestOptions, SamplingParams
from engine.sequence import Sequence

PROMPTS = [[5 + i, 7, 9 + 2 * i, 11] * (1 + i % 3) + [20 + i] * (i % 3) for i in range(8)]
PENALTIES = dict(presence_penalty=1.5, frequency_penalty=0.7, repetition_penalty=1.3,
                 logit_bias={"40": 3.0, "41": -100, "7": 2.5})


def _seq(prompt, output, **params):
    seq = Sequence("s", list(prompt), SamplingParams(**params), RequestOptions())
    seq.token_ids += output
    seq.processor = RequestProcessor(seq.params, len(prompt), 50)
    return seq


def _expected(logits, prompt, context, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """The formula, written out per vocabulary entry."""
    out = logits.clone()
    for v in range(len(out)):
        if v in prompt or v in context:
            out[v] = out[v] / repetition if out[v] > 0 else out[v] * repetition
        count = context.count(v)
        out[v] -= count * frequency + (count > 0) * presence
        out[v] += (bias or {}).get(v, 0.0)
    return out


def test_rows_follow_the_formula_with_the_drafts_before_them():
    """Row j counts the output plus the j tokens drafted before it. Red when the drafts are
    left out or counted one too many, when presence counts repeats, when the prompt counts as
    output for frequency/presence, or when a bias lands on the wrong id."""
    torch.manual_seed(0)
    prompt, output, drafted = [3, 4, 4, 9], [4, 5, 5, 6], [5, 8, 8]
    params = dict(presence_penalty=0.6, frequency_penalty=-0.4, repetition_penalty=1.7,
                  logit_bias={"8": 4.0, "2": -3.5})
    seq = _seq(prompt, output, **params)
    logits = torch.randn(len(drafted) + 1, 50)
    got = process(logits, [(seq, drafted[:j]) for j in range(len(drafted) + 1)])
    for j in range(len(drafted) + 1):
        want = _expected(logits[j], prompt, output + drafted[:j], 0.6, -0.4, 1.7, {8: 4.0, 2: -3.5})
        torch.testing.assert_close(got[j], want)
    assert not torch.equal(got[0], got[3])        # the drafts changed the later rows


def test_rows_without_processing_are_not_touched():
    torch.manual_seed(1)
    plain = Sequence("p", [1, 2], SamplingParams(), RequestOptions())
    logits = torch.randn(3, 50)
    assert process(logits, [(plain, [])] * 3) is logits            # nothing to do: no copy
    seq = _seq([1, 2], [3], presence_penalty=2.0)
    got = process(logits, [(plain, []), (seq, []), (plain, [3])])
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert got[1, 3] == logits[1, 3] - 2.0


def test_state_follows_emitted_tokens_only():
    """Tokens drafted in one call never stay in the sequence's state (no rollback needed)."""
    torch.manual_seed(2)
    seq = _seq([1], [2], frequency_penalty=1.0)
    logits = torch.zeros(1, 50)
    process(logits, [(seq, [7, 7])])
    assert process(logits, [(seq, [])])[0, 7] == 0.0
    seq.token_ids.append(7)
    assert process(logits, [(seq, [])])[0, 7] == -1.0


def test_bias_ids_beyond_the_vocabulary_are_refused(make_engine):
    engine = make_engine(draft=False)
    vocab = engine.target_model.vocab_size
    with pytest.raises(InvalidParamError) as err:
        engine.add_request("r", [1, 2], SamplingParams(logit_bias={str(vocab): 1.0}))
    assert err.value.param == "logit_bias"
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(logit_bias={"1": 101}),
                dict(logit_bias={"x": 1}), dict(repetition_penalty=0),
                dict(logit_bias={str(i): 1 for i in range(301)})):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def _greedy(**kw):
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **kw)


def test_greedy_speculative_equals_plain_decoding_with_penalties(make_engine):
    """Speculative (k 1..4, arriving at different steps) == plain decoding without a draft,
    token for token, with penalties and bias. Red when the verify rows ignore the drafts before
    them (a rejected draft's penalty leaks into the next row, or an accepted one's is missing)."""
    plain = []
    for p in PROMPTS:
        engine = make_engine(draft=False)
        engine.add_request("p", p, _greedy(**PENALTIES))
        plain.append(run_all(engine)[0]["p"])
    bare = make_engine(draft=False)
    bare.add_request("b", PROMPTS[0], _greedy())
    assert run_all(bare)[0]["b"] != plain[0]           # the processing changes the text
    engine = make_engine(adaptive_k=False, max_num_batched_tokens=64)
    rng, arrivals = random.Random(1), {}
    for i, p in enumerate(PROMPTS):
        opts = RequestOptions(mode="speculative" if i % 4 else "baseline", k_max=1 + i % 4)
        arrivals.setdefault(rng.randrange(5), []).append((f"r{i}", p, _greedy(**PENALTIES), opts))
    outs, _ = run_all(engine, arrivals)
    snap = engine.snapshot()
    assert 0 < snap.num_accepted_tokens < snap.num_draft_tokens
    assert [outs[f"r{i}"] for i in range(len(PROMPTS))] == plain


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_target_as_its_own_draft_accepts_every_processed_draft(make_engine, tiny_family,
                                                                    temperature):
    """With q == p row by row, every draft is accepted. Red when the draft's rows are not
    processed, or processed without (or with one too many of) the drafts before them."""
    engine = make_engine(draft=tiny_family["target"], adaptive_k=False)
    for i, p in enumerate(PROMPTS[:4]):
        params = SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True,
                                seed=None, **PENALTIES)
        engine.add_request(f"r{i}", p, params, RequestOptions("speculative", k_max=4))
    run_all(engine)
    snap = engine.snapshot()
    assert snap.num_draft_tokens > 40
    assert snap.num_accepted_tokens == snap.num_draft_tokens


def _exact_probs(hf_target, prompt, output, temperature=0.8, top_k=3):
    """The processed target distribution at the position after `output`, by the formula."""
    with torch.no_grad():
        logits = hf_target(torch.tensor([prompt + output])).logits[0, -1].double()
    bias = {int(t): b for t, b in PENALTIES["logit_bias"].items()}
    logits = _expected(logits, prompt, output, PENALTIES["presence_penalty"],
                       PENALTIES["frequency_penalty"], PENALTIES["repetition_penalty"], bias)
    top = (logits / temperature).topk(top_k)
    return dict(zip(top.indices.tolist(), top.values.softmax(0).tolist()))


def test_sampled_speculative_output_has_the_processed_distribution(make_engine, hf_target):
    """Joint law of the first three tokens (top-k 3, T 0.8, penalties and bias) through
    speculative steps (k = 2) against the processed target's exact law: 27 cells, chi-square.
    Red when the target's rows are not processed (or processed without the drafts before
    them), or when the rejection rule compares unprocessed q."""
    prompt = [5, 7, 9, 11, 40, 13]
    params = dict(temperature=0.8, top_k=3, max_tokens=3, ignore_eos=True, **PENALTIES)
    engine = make_engine(adaptive_k=False, max_num_seqs=64, max_waiting=4000)
    n = 3000
    for i in range(n):
        engine.add_request(f"s{i}", prompt, SamplingParams(**params),
                           RequestOptions("speculative", k_max=2))
    outs, _ = run_all(engine)
    assert 0 < engine.snapshot().num_accepted_tokens < engine.snapshot().num_draft_tokens
    p_value = three_token_pvalue(lambda done: _exact_probs(hf_target, prompt, done), outs, n)
    assert p_value > 1e-3


def test_seeded_speculative_equals_seeded_plain_with_processing(make_engine):
    """Seeded rows couple on the processed distributions: the text equals seeded plain decoding
    with the same processing and grammar, whatever k is. Red when the verify rows are processed
    without the drafts before them."""
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "string", "maxLength": 5},
                                                          "b": {"type": "boolean"}},
                         "required": ["a", "b"]})

    def params(i):
        return SamplingParams(temperature=0.9, seed=100 + i, max_tokens=30,
                              json_schema=schema if i % 2 else None, **PENALTIES)

    plain = []
    for i, p in enumerate(PROMPTS):
        engine = make_engine(draft=False)
        engine.add_request("p", p, params(i))
        plain.append(run_all(engine)[0]["p"])
    engine = make_engine(adaptive_k=False)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params(i), RequestOptions("speculative", k_max=1 + i % 4))
    outs, _ = run_all(engine)
    assert engine.snapshot().num_accepted_tokens > 0
    assert [outs[f"r{i}"] for i in range(len(PROMPTS))] == plain
