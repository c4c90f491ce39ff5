"""The engine's hardening: bad values are refused, no request is lost, a fault hurts only its
step. Each test guards one defect and fails with it put back.
"""

import dataclasses

import pytest
import torch

from conftest import hf_greedy, run_all
from engine.rejection_sampler import rejection_sample
from engine.sampler import RowParams, probabilities
from engine.sampling_params import FinishReason, Mode, RequestOptions, SamplingParams

PROMPT = [5, 7, 9, 11, 13]
BLOCK = 2 * 2 * 2 * 16 * 4 * 16      # tiny target: one 16-token block in bytes


# ---- sampling math ----------------------------------------------------------------------------
def test_a_token_the_target_never_emits_is_never_accepted_even_at_u_zero():
    p = torch.tensor([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])        # p(token 0) = 0
    q = torch.tensor([[1.0, 0.0, 0.0]])                               # the draft proposed token 0
    accepted, out = rejection_sample(torch.tensor([0]), [1], p.argmax(-1), [False], p, q,
                                     torch.tensor([0.0]), [None])
    assert accepted == [0]
    assert out[0][0] != 0


@pytest.mark.parametrize("logits", [[0.5, 3.0, 1.0, -2.0], [-3.0, -0.5, -1.0, -2.0]])
def test_tiny_temperatures_are_greedy(logits):
    # All-negative logits / 1e-38 are all -inf: softmax would be NaN and argmax token 0.
    logits = torch.tensor([logits])
    for t in (1e-38, 1e-20, 1e-6):
        params = SamplingParams(temperature=t)
        assert params.greedy
        probs = probabilities(logits, RowParams.build([params], [None], "cpu"))
        assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    # The same through RowParams built by hand (the sampler alone must not overflow either):
    # 1e-40 is a float32 subnormal, and every logit divided by it is +-inf.
    rp = RowParams(torch.tensor([1e-40]), torch.tensor([0]), torch.tensor([1.0]), [None])
    assert probabilities(logits, rp).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_one_rows_top_p_does_not_trim_another_rows_tail():
    # Row 1's second token has probability ~2e-9: the float32 running mass reaches 1.0 before it.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [20.0, 0.0, -30.0, -30.0]])
    alone = probabilities(logits[1:], RowParams.build([SamplingParams()], [None], "cpu"))
    both = probabilities(logits, RowParams.build([SamplingParams(top_p=0.5), SamplingParams()],
                                                 [None, None], "cpu"))
    assert alone[0, 1] > 0
    assert torch.equal(both[1] > 0, alone[0] > 0)
    torch.testing.assert_close(both[1], alone[0])
    assert (both[0] > 0).tolist() == [True, False, False, False]       # row 0 is still cut


# ---- validation -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    {"top_k": 2.5}, {"top_k": 9223372036854775808}, {"top_k": True}, {"top_k": -1},
    {"max_tokens": 2.0}, {"max_tokens": True}, {"temperature": "1"}, {"temperature": float("nan")},
    {"top_p": float("nan")}, {"top_p": 0}, {"seed": 1.5}, {"seed": 2 ** 64},
    {"stop_token_ids": [5.5]}, {"stop_token_ids": [-1]}, {"stop": [""]}, {"stop": [3]},
    {"ignore_eos": "yes"},
])
def test_bad_sampling_values_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_cannot_change_after_validation():
    params = SamplingParams(top_k=5, stop=["x"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.top_k = 2 ** 63
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = -1.0
    assert params.stop == ("x",)                   # a tuple: the list cannot be edited in place


def test_non_integer_token_ids_and_options_are_refused(make_engine):
    engine = make_engine()
    for bad in ([5, 5.5, 7], [5, True], [5, "7"]):
        with pytest.raises(ValueError, match="integers"):
            engine.add_request("x", bad, SamplingParams())
    with pytest.raises(ValueError, match="k_max"):
        RequestOptions("speculative", k_max=2.5)
    assert not engine.seqs and not engine.has_unfinished()


# ---- no request lost --------------------------------------------------------------------------
def _run_collect(engine):
    outs, finals = run_all(engine)
    assert not engine.has_unfinished() and not engine.seqs
    assert engine.pool.num_free == engine.pool.num_blocks
    return outs, finals


def test_a_request_outgrowing_the_kv_pool_ends_with_length_and_a_final_output(make_engine):
    engine = make_engine(draft=False, kv_budget_bytes=4 * BLOCK)       # 64 tokens in all
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine.add_request("a", [5] * 40, params)                           # fits; its growth does not
    outs, finals = _run_collect(engine)
    assert "a" in finals, "the request vanished without a final output"
    assert finals["a"].finished and finals["a"].finish_reason == FinishReason.LENGTH
    assert finals["a"].kv_target_bytes == 0
    assert len(outs["a"]) == 64 + 1 - 40       # 64 tokens with KV, then the pending one
    engine.add_request("a", [5] * 10, SamplingParams(temperature=0, max_tokens=2))   # id freed
    _, finals = _run_collect(engine)
    assert finals["a"].finish_reason == FinishReason.LENGTH


def test_preempted_requests_that_outgrow_the_pool_still_end(make_engine):
    engine = make_engine(kv_budget_bytes=5 * BLOCK)                     # 80 tokens in all
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i] * 20, params, RequestOptions("speculative", k_max=3))
    outs, finals = _run_collect(engine)
    assert sorted(finals) == ["r0", "r1", "r2"]
    assert all(f.finish_reason == FinishReason.LENGTH for f in finals.values())
    assert engine.scheduler.num_preemptions > 0


# ---- fault isolation --------------------------------------------------------------------------
def _poison(params: SamplingParams) -> SamplingParams:
    """What validation refuses, forced in afterwards: the engine must survive whatever reaches it."""
    object.__setattr__(params, "top_k", 9223372036854775808)
    return params


def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(make_engine, hf_target):
    engine = make_engine()
    engine.add_request("bad", PROMPT, _poison(SamplingParams(temperature=1.0, max_tokens=8)))
    outs, finals = run_all(engine)
    assert finals["bad"].finish_reason == FinishReason.ERROR and finals["bad"].error
    assert "bad" not in engine.seqs and engine.pool.num_free == engine.pool.num_blocks
    # A request in the same step as the bad one fails with it; later ones are served normally.
    engine.add_request("bad2", PROMPT, _poison(SamplingParams(temperature=1.0, max_tokens=8)))
    engine.add_request("mate", PROMPT, SamplingParams(temperature=0, max_tokens=8))
    outs, finals = run_all(engine)
    assert finals["bad2"].error and finals["mate"].error
    engine.add_request("good", PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       RequestOptions("speculative", k_max=3))
    outs, finals = _run_collect(engine)
    assert finals["good"].error is None and outs["good"] == hf_greedy(hf_target, PROMPT, 8)
    assert engine.snapshot().num_failed_steps == 2


def test_a_failing_draft_drops_its_requests_to_baseline_and_they_finish(make_engine, hf_target):
    engine = make_engine(adaptive_k=False, fault_injection=True)
    prompts = {f"r{i}": [5 + i, 7, 9 + i, 11] * 3 for i in range(3)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                           RequestOptions("speculative", k_max=3))
    outs, finals = {}, {}
    for _ in range(3):                                   # prefill, then speculative steps
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
    assert engine.pool.used_by["draft"] > 0
    engine.inject_fault("draft_raise")                   # the draft's next forward raises
    changed = engine.step()
    for o in changed:
        outs.setdefault(o.request_id, []).extend(o.token_ids)
        assert o.mode == Mode.BASELINE and o.reason == "draft_unavailable"
        assert o.kv_draft_bytes == 0 and o.error is None
    assert {o.request_id for o in changed} == set(prompts)
    assert engine.pool.used_by["draft"] == 0 and engine.stats().kv_used_draft_bytes == 0
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                finals[o.request_id] = o
    for rid, p in prompts.items():
        assert outs[rid] == hf_greedy(hf_target, p, 24), rid          # still lossless
        assert finals[rid].finish_reason == FinishReason.LENGTH
        assert finals[rid].reason == "draft_unavailable"
    assert engine.snapshot().num_draft_failures == 1
    assert engine.pool.num_free == engine.pool.num_blocks


def test_fault_injection_is_off_by_default(make_engine):
    with pytest.raises(RuntimeError, match="fault injection is off"):
        make_engine().inject_fault("draft_raise")
