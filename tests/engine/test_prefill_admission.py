"""A new prompt is prefilled in the very next step, alongside sequences that are decoding."""

import pytest

from engine.sampling_params import RequestOptions, SamplingParams


def test_new_prompt_starts_next_step_while_others_decode(make_engine):
    engine = make_engine(max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"d{i}", [3 + i, 5, 7, 9], params, RequestOptions("speculative", k_max=3))
    for _ in range(3):
        engine.step()
    prompt = list(range(10, 40))                       # fits in what the decodes leave of 64
    engine.add_request("new", prompt, params)
    outs = engine.step()
    got = {o.request_id: o for o in outs}
    assert "new" in got and len(got["new"].token_ids) == 1     # first token in this step
    assert all(f"d{i}" in got for i in range(4))               # the decodes ran in it too
    # A prompt longer than the budget left is chunked over the next steps, decodes continuing.
    engine.add_request("long", list(range(10, 110)), params)
    steps = 0
    while "long" not in {o.request_id for o in engine.step()}:
        steps += 1
        assert steps < 4
    assert steps >= 1


@pytest.mark.parametrize("prefill_first", [True, False])
def test_a_step_that_admits_a_prompt_runs_no_draft_rounds(make_engine, prefill_first):
    """Time to first token: the step that prefills a new prompt does not also wait for the
    running batch's draft rounds (prefill_first); the next step drafts again. A queue that
    waits for memory does not hold speculation off (test_memory covers that budget)."""
    engine = make_engine(adaptive_k=False, prefill_first=prefill_first)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", [5, 7, 9, 11], params, RequestOptions("speculative", k_max=3))
    seen = []
    schedule = engine.scheduler.schedule

    def record():
        items = schedule()
        seen.append({it.seq.request_id: it.k for it in items})
        return items

    engine.scheduler.schedule = record
    for _ in range(3):
        engine.step()
    assert seen[-1] == {"a": 3}
    engine.add_request("b", [6, 8, 10], params, RequestOptions("speculative", k_max=3))
    engine.step()
    assert seen[-1] == {"a": 0 if prefill_first else 3, "b": 0}
    engine.step()
    assert seen[-1] == {"a": 3, "b": 3}
