"""A new prompt is prefilled in the very next step, alongside sequences that are decoding."""

import pytest
from conftest import run_all

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


def _recording(engine) -> list[dict]:
    """Every step's schedule: request id -> k."""
    seen, schedule = [], engine.scheduler.schedule

    def record():
        items = schedule()
        seen.append({it.seq.request_id: it.k for it in items})
        return items

    engine.scheduler.schedule = record
    return seen


@pytest.mark.parametrize("mode", ["mixed", "no_draft", "alone"])
def test_a_step_that_admits_a_prompt_by_prefill_mode(make_engine, mode):
    """Time to first token: the step that prefills a new prompt also drafts for the running
    batch (mixed), decodes it without draft rounds (no_draft), or leaves it out (alone); the
    next step drafts again. A queue that waits for memory does not hold speculation off
    (test_memory covers that budget)."""
    engine = make_engine(adaptive_k=False, prefill_mode=mode)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", [5, 7, 9, 11], params, RequestOptions("speculative", k_max=3))
    seen = _recording(engine)
    for _ in range(3):
        engine.step()
    assert seen[-1] == {"a": 3}
    engine.add_request("b", [6, 8, 10], params, RequestOptions("speculative", k_max=3))
    engine.step()
    assert seen[-1] == {"mixed": {"a": 3, "b": 0}, "no_draft": {"a": 0, "b": 0},
                        "alone": {"b": 0}}[mode]
    engine.step()
    assert seen[-1] == {"a": 3, "b": 3}


def test_prompts_alone_never_starve_the_batch(make_engine):
    """A new prompt every step: the running batch still decodes every other step."""
    engine = make_engine(adaptive_k=False, prefill_mode="alone", max_num_seqs=64)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine.add_request("a", [5, 7, 9, 11], params, RequestOptions("speculative", k_max=2))
    seen = _recording(engine)
    engine.step()
    engine.step()
    for i in range(12):
        engine.add_request(f"n{i}", [6, 8, 10 + i], params)
        engine.step()
    assert ["a" in step for step in seen[2:]] == [False, True] * 6
    assert all(len(step) == 1 for step in seen[2::2])        # the prompt alone


def test_prefill_mode_does_not_change_greedy_tokens(make_engine):
    """The same requests, arriving at the same steps, give the same greedy tokens in every mode
    (the steps differ; the kernels are batch-invariant, prompts are cut at fixed offsets)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    arrivals = {0: [("s0", [3, 5, 7, 9, 11], params, RequestOptions("speculative", k_max=3))],
                2: [("b0", list(range(20, 60)), params, RequestOptions("baseline"))],
                3: [("s1", list(range(30, 45)), params, RequestOptions("speculative", k_max=4))],
                7: [("s2", [4, 4, 4, 8], params, RequestOptions("speculative", k_max=2)),
                    ("b1", list(range(70, 150)), params, RequestOptions("baseline"))]}
    results, steps = {}, {}
    for mode in ("mixed", "no_draft", "alone"):
        engine = make_engine(prefill_mode=mode, max_num_batched_tokens=64, adaptive_k=False)
        steps[mode] = _recording(engine)
        results[mode] = run_all(engine, arrivals)[0]
    assert results["alone"] == results["mixed"] == results["no_draft"]
    assert all(len(v) == 24 for v in results["mixed"].values())
    assert {"b0": 0} in steps["alone"] and {"b0": 0} not in steps["mixed"]    # b0's prompt alone
    assert {"s0": 0, "b0": 0} in steps["no_draft"] and {"s0": 3, "b0": 0} in steps["mixed"]


def test_an_unknown_prefill_mode_is_refused(tiny_family):
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="prefill_mode must be one of"):
        EngineConfig(str(tiny_family["target"]), prefill_mode="first")
