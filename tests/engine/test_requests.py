"""Stop strings, stop ids, max_tokens, abort, seeds, validation; and sampled output's distribution."""

import pytest
import torch

from conftest import run_all, three_token_pvalue
from engine.errors import EngineOverloadedError, PromptTooLongError
from engine.sampling_params import FinishReason, RequestOptions, SamplingParams

PROMPT = [5, 7, 9, 11, 13]


def test_max_tokens_and_stop_token_ids(make_engine):
    engine = make_engine()
    engine.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                       RequestOptions("speculative", k_max=4))
    outs, finals = run_all(engine)
    assert len(outs["a"]) == 7 and finals["a"].finish_reason == FinishReason.LENGTH
    stop_at = outs["a"][3]
    engine.add_request("b", PROMPT, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True,
                                                   stop_token_ids=[stop_at]),
                       RequestOptions("speculative", k_max=4))
    outs2, finals2 = run_all(engine)
    first = outs["a"].index(stop_at)
    assert outs2["b"] == outs["a"][:first + 1]
    assert finals2["b"].finish_reason == FinishReason.STOP


def test_stop_string_cuts_the_text(make_engine):
    engine = make_engine()
    engine.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    _, finals = run_all(engine)
    full = engine.tokenizer.decode(_tokens(engine, "a2", PROMPT, 16, temperature=0))
    stop = full[5:8]
    engine.add_request("b", PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                   stop=[stop]), RequestOptions("speculative"))
    text, final = "", None
    while engine.has_unfinished():
        for o in engine.step():
            text += o.text
            final = o
    assert final.finish_reason == FinishReason.STOP
    assert text == full[:full.find(stop)]


def _tokens(engine, rid, prompt, n, **kw):
    engine.add_request(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True, **kw),
                       RequestOptions("speculative", k_max=3))
    outs, _ = run_all(engine)
    return outs[rid]


def test_seeded_requests_reproduce(make_engine):
    engine = make_engine(adaptive_k=False)
    a = _tokens(engine, "a", PROMPT, 12, temperature=1.0, seed=123)
    b = _tokens(engine, "b", PROMPT, 12, temperature=1.0, seed=123)
    c = _tokens(engine, "c", PROMPT, 12, temperature=1.0, seed=124)
    assert a == b and a != c


def test_validation_errors(make_engine):
    engine = make_engine(max_model_len=32, max_waiting=2)
    with pytest.raises(PromptTooLongError, match="at most 31"):
        engine.add_request("x", [5] * 40, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("x", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("x", [10**6], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    engine.add_request("w1", PROMPT, SamplingParams())
    engine.add_request("w2", PROMPT, SamplingParams())
    with pytest.raises(EngineOverloadedError):
        engine.add_request("w3", PROMPT, SamplingParams())
    engine.abort("w1"), engine.abort("w2")
    assert not engine.has_unfinished()


def test_sampled_speculative_output_has_the_target_distribution(make_engine, hf_target):
    """Joint law of the first three tokens (top-k 3, T 0.8) through the engine vs. exact target.

    Token 1 comes from prefill; tokens 2-3 come from speculative steps (k = 2): accepted drafts,
    recovered and bonus tokens all contribute. 27 cells, chi-square.
    """
    params = dict(temperature=0.8, top_k=3, max_tokens=3, ignore_eos=True)
    engine = make_engine(adaptive_k=False, max_num_seqs=64, max_waiting=4000)
    n = 3000
    for i in range(n):
        engine.add_request(f"s{i}", PROMPT, SamplingParams(**params), RequestOptions("speculative", k_max=2))
    outs, _ = run_all(engine)
    assert engine.snapshot().num_accepted_tokens > 0
    assert engine.snapshot().num_draft_tokens > engine.snapshot().num_accepted_tokens

    def probs(prefix):
        with torch.no_grad():
            logits = hf_target(torch.tensor([prefix])).logits[0, -1] / 0.8
        top = logits.topk(3)
        return dict(zip(top.indices.tolist(), top.values.softmax(0).tolist()))

    p_value = three_token_pvalue(lambda done: probs(PROMPT + done), outs, n)
    assert p_value > 1e-3
