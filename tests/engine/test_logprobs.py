"""Log-probabilities are the target's, before temperature / top-k / top-p, whatever produced the
token: a speculative run reports what plain decoding reports for the same tokens, and both equal
the log-softmax of an independent transformers forward over prompt + output."""

import os

import pytest
import torch

from engine.sampling_params import RequestOptions, SamplingParams

PROMPTS = [[5 + i, 7, 9 + 2 * i, 11] * (1 + i % 3) + [20 + i] * (i % 2) for i in range(6)]
N_NEW = 16
TOP = 5
DTYPE = os.environ.get("SPECSERVE_TEST_DTYPE", "float32")
ATOL = 1e-4 if DTYPE == "float32" else 5e-2
fp32_only = pytest.mark.skipif(DTYPE != "float32", reason="the transformers reference runs in float32")


def _run(engine, mode, params, k_max=4, prompts=PROMPTS):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, RequestOptions(mode=mode, k_max=k_max))
    lps, prompt_lps, outs = {}, {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
            if o.logprobs is not None:
                lps.setdefault(o.request_id, []).extend(o.logprobs)
            else:
                assert not o.token_ids or params.logprobs is None
            if o.prompt_logprobs is not None:
                assert o.request_id not in prompt_lps        # handed out once
                prompt_lps[o.request_id] = o.prompt_logprobs
    return outs, lps, prompt_lps


def _reference(hf_target, prompt, output):
    """log_softmax of one transformers forward over prompt + output: [len - 1, vocab], row i
    scoring token i + 1."""
    with torch.no_grad():
        logits = hf_target(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def _check_against(ref_rows, tokens, entries, top):
    assert len(entries) == len(tokens)
    for row, t, e in zip(ref_rows, tokens, entries):
        assert e.token_id == t
        assert e.logprob == pytest.approx(row[t].item(), abs=ATOL)
        assert len(e.top) == top
        values = [v for _, v in e.top]
        assert values == sorted(values, reverse=True)
        want = row.topk(top)
        assert [v for v in values] == pytest.approx(want.values.tolist(), abs=ATOL)
        assert [i for i, _ in e.top] == want.indices.tolist()


def test_speculative_logprobs_equal_plain_decoding(make_engine):
    """Greedy: same tokens, and per token the same logprob and alternatives, for a speculative
    run (k 1..4, drafts accepted and rejected) and a baseline run."""
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logprobs=TOP)
    engine = make_engine(adaptive_k=False, max_num_batched_tokens=64)
    base, base_lp, _ = _run(engine, "baseline", params)
    spec, spec_lp, _ = _run(engine, "speculative", params)
    assert engine.snapshot().num_accepted_tokens > 0
    assert spec == base
    for rid in base:
        assert len(spec_lp[rid]) == len(base_lp[rid]) == N_NEW
        for s, b in zip(spec_lp[rid], base_lp[rid]):
            assert s.token_id == b.token_id
            assert s.logprob == pytest.approx(b.logprob, abs=ATOL)
            assert [i for i, _ in s.top] == [i for i, _ in b.top]
            assert s.top[0][0] == s.token_id      # greedy: the chosen token is the best


@fp32_only
@pytest.mark.parametrize("mode", ["baseline", "speculative"])
def test_logprobs_equal_an_independent_forward(make_engine, hf_target, mode):
    """Sampled at temperature 0.7 with top-k: the reported values are the raw model's
    log-softmax (before temperature and the cut), at every emitted token."""
    params = SamplingParams(temperature=0.7, top_k=20, max_tokens=N_NEW, ignore_eos=True,
                            logprobs=TOP, seed=3)
    engine = make_engine(adaptive_k=False, max_num_batched_tokens=64)
    outs, lps, _ = _run(engine, mode, params, k_max=3)
    for i, p in enumerate(PROMPTS):
        out = outs[f"r{i}"]
        ref = _reference(hf_target, p, out)[len(p) - 1:]
        _check_against(ref, out, lps[f"r{i}"], TOP)


@fp32_only
@pytest.mark.parametrize("mode", ["baseline", "speculative"])
def test_prompt_logprobs_over_chunked_prefill(make_engine, hf_target, mode):
    """Prompts of 12..39 tokens cut into prefill chunks of at most 16 tokens: every prompt token but the first is scored
    once, as the independent forward scores it; the output's logprobs follow on."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1,
                            prompt_logprobs=2)
    engine = make_engine(adaptive_k=False, max_num_batched_tokens=16)
    prompts = [p * 3 for p in PROMPTS]
    outs, lps, prompt_lps = _run(engine, mode, params, prompts=prompts)
    for i, p in enumerate(prompts):
        got = prompt_lps[f"r{i}"]
        assert len(got) == len(p) and got[0] is None
        ref = _reference(hf_target, p, outs[f"r{i}"])
        _check_against(ref[:len(p) - 1], p[1:], got[1:], 2)
        _check_against(ref[len(p) - 1:], outs[f"r{i}"], lps[f"r{i}"], 1)


def test_requests_that_do_not_ask_get_none(make_engine):
    """Mixed batch: only the asking request carries logprobs; the others' outputs have none."""
    engine = make_engine(adaptive_k=False)
    asking = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], asking, RequestOptions(mode="speculative", k_max=3))
    engine.add_request("b", PROMPTS[1], plain, RequestOptions(mode="speculative", k_max=3))
    seen = {"a": 0, "b": 0}
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == "b":
                assert o.logprobs is None and o.prompt_logprobs is None
            else:
                assert len(o.logprobs) == len(o.token_ids)
                assert all(e.top == [] for e in o.logprobs)
            seen[o.request_id] += len(o.token_ids)
    assert seen == {"a": 6, "b": 6}


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, True, 1.0])
def test_bad_counts_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_only_the_asking_rows_are_scored(make_engine, monkeypatch):
    """The cost rule: one log-softmax row per token the asking request emits (and per prompt
    token it scores), none for the request beside it in the same steps."""
    import engine.spec_decode as spec_decode

    rows = []
    real = spec_decode.row_logprobs

    def counting(logits, token_ids, num_top):
        rows.append(logits.shape[0])
        return real(logits, token_ids, num_top)

    monkeypatch.setattr(spec_decode, "row_logprobs", counting)
    engine = make_engine(adaptive_k=False)
    asking = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2,
                            prompt_logprobs=0)
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", PROMPTS[2], asking, RequestOptions(mode="speculative", k_max=3))
    engine.add_request("b", PROMPTS[3], plain, RequestOptions(mode="speculative", k_max=3))
    emitted = 0
    while engine.has_unfinished():
        for o in engine.step():
            emitted += len(o.token_ids) if o.request_id == "a" else 0
    assert sum(rows) == emitted + len(PROMPTS[2]) - 1


@fp32_only
def test_preempted_requests_score_each_token_once(make_engine, hf_target):
    """A KV pool of 80 tokens for three 20-token prompts growing by 40: sequences are preempted
    and prefilled again (output included); each prompt token is still scored once, each
    output token has one entry, and the values are the independent forward's."""
    block = 2 * 2 * 2 * 16 * 4 * 16     # tiny target's KV block in float32 (tests/engine/test_memory.py)
    engine = make_engine(kv_budget_bytes=5 * block, adaptive_k=False, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1,
                            prompt_logprobs=1)
    prompts = [[5 + i, 9, 40 + i, 7] * 5 for i in range(3)]
    outs, lps, prompt_lps = _run(engine, "speculative", params, k_max=3, prompts=prompts)
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        out = outs[f"r{i}"]
        assert len(out) == 40 and len(prompt_lps[f"r{i}"]) == len(p)
        ref = _reference(hf_target, p, out)
        _check_against(ref[:len(p) - 1], p[1:], prompt_lps[f"r{i}"][1:], 1)
        _check_against(ref[len(p) - 1:], out, lps[f"r{i}"], 1)


@pytest.mark.parametrize("mode", ["baseline", "speculative"])
def test_prompt_logprobs_of_a_cached_prompt_are_all_there(make_engine, mode):
    """A prompt whose prefix is cached (sent before) is still scored from its second token: a
    request asking for prompt logprobs does not skip its prefill (it needs those rows)."""
    prompt = [5 + (7 * i) % 250 for i in range(200)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    engine = make_engine(adaptive_k=False, max_num_batched_tokens=256)
    first = _run(engine, mode, params, prompts=[prompt])
    second = _run(engine, mode, params, prompts=[prompt])
    assert second[0] == first[0]
    a, b = first[2]["r0"], second[2]["r0"]
    assert len(a) == len(b) == len(prompt)
    for x, y in zip(a[1:], b[1:]):
        assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=ATOL)


@fp32_only
@pytest.mark.parametrize("mode", ["baseline", "speculative"])
def test_kept_logits_are_the_rows_each_token_was_sampled_from(make_engine, hf_target, mode):
    """`RequestOptions.keep_logits` (distillation's writer): each output carries one row per new
    token, the raw model's logits there (bf16), as the independent forward gives them; without
    detokenizing, the tokens are the same and the text is empty."""
    params = SamplingParams(temperature=1.0, max_tokens=N_NEW, ignore_eos=True, seed=5)
    engine = make_engine(adaptive_k=False, max_num_batched_tokens=64)
    plain, _, _ = _run(engine, mode, params, k_max=3)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"k{i}", p, params, RequestOptions(mode=mode, k_max=3, keep_logits=True,
                                                              detokenize=False))
    outs, rows = {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.text == ""
            outs.setdefault(o.request_id, []).extend(o.token_ids)
            assert (o.logits is None) == (not o.token_ids)
            if o.logits is not None:
                assert o.logits.dtype == torch.bfloat16 and len(o.logits) == len(o.token_ids)
                rows.setdefault(o.request_id, []).append(o.logits)
    for i, p in enumerate(PROMPTS):
        out = outs[f"k{i}"]
        assert out == plain[f"r{i}"]
        got = torch.log_softmax(torch.cat(rows[f"k{i}"]).float(), -1)
        ref = _reference(hf_target, p, out)[len(p) - 1:]
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, atol=0.05)      # bf16 rows of float32 logits


def test_stop_strings_need_detokenizing(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="stop strings need detokenize"):
        engine.add_request("s", PROMPTS[0], SamplingParams(max_tokens=2, stop=["x"]),
                           RequestOptions(detokenize=False))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("field", ["keep_logits", "detokenize"])
def test_the_writer_options_take_booleans_only(field):
    with pytest.raises(ValueError, match=f"{field} must be true or false"):
        RequestOptions(**{field: "yes"})
