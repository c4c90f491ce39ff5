"""A new prompt is prefilled in the very next step, alongside sequences that are decoding."""

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
