"""The engine reports how many output tokens each request produced in speculative mode (the
ingress prices them at the speculative price, the rest at the baseline price)."""

import random

from conftest import run_all
from engine.sampling_params import FinishReason, Mode, RequestOptions, SamplingParams

from test_memory import BLOCK


def _params(n=24):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_speculative_and_baseline_requests_report_their_split(make_engine):
    engine = make_engine(adaptive_k=False)
    engine.add_request("spec", [5, 6, 7, 8], _params(), RequestOptions("speculative", k_max=3))
    engine.add_request("base", [5, 6, 7, 8], _params(), RequestOptions("baseline"))
    finals = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
    spec, base = finals["spec"], finals["base"]
    assert spec.num_output_tokens == 24 and spec.num_speculative_tokens == 24
    assert spec.num_draft_tokens > 0 and 0 <= spec.num_accepted_tokens <= spec.num_draft_tokens
    assert spec.acceptance_rate == spec.num_accepted_tokens / spec.num_draft_tokens
    assert base.num_speculative_tokens == 0 and base.num_draft_tokens == 0


def test_a_downgraded_request_counts_only_what_it_emitted_while_speculating(make_engine):
    """Tight KV: the engine drops speculation mid-request; the count follows the mode that each
    step's tokens were emitted in, as seen from the outputs themselves."""
    engine = make_engine(kv_budget_bytes=10 * BLOCK, adaptive_k=False, max_num_batched_tokens=64)
    rng = random.Random(3)
    seen_spec: dict[str, int] = {}
    finals = {}
    for i in range(12):
        prompt = [rng.randrange(1, 300) for _ in range(rng.randrange(3, 30))]
        engine.add_request(f"r{i}", prompt, _params(40), RequestOptions("speculative", k_max=4))
    while engine.has_unfinished():
        for o in engine.step():
            if o.mode == Mode.SPECULATIVE:
                seen_spec[o.request_id] = seen_spec.get(o.request_id, 0) + len(o.token_ids)
            assert o.num_speculative_tokens == seen_spec.get(o.request_id, 0)
            if o.finished:
                finals[o.request_id] = o
    assert engine.scheduler.num_spec_downgrades > 0
    dropped = [o for o in finals.values() if 0 < o.num_speculative_tokens < o.num_output_tokens]
    assert dropped, "some request was meant to lose speculation midway"
    assert all(o.mode == Mode.BASELINE for o in dropped)


def test_a_stop_inside_a_step_counts_only_the_tokens_kept(make_engine, tiny_family):
    """A stop token among a step's accepted drafts ends the request there: the tokens the step
    emitted after it are dropped, and they are not counted as speculative output either (the
    ingress prices that count). The draft is the target itself, so every draft is accepted and
    a step emits k + 1 = 5 tokens; the stop token is one inside a step.

    Breaks when `_apply` counts the step's tokens (`num_speculative_output += len(r.tokens)`)
    instead of those kept up to the stop: the request reports more speculative tokens than
    output tokens. The other billing tests set `ignore_eos` and stop nowhere mid-step."""
    params = dict(temperature=0, max_tokens=30, ignore_eos=True)
    plain = make_engine(draft=False)
    plain.add_request("plain", [5, 6, 7, 8], SamplingParams(**params))
    outs, _ = run_all(plain)
    tokens = outs["plain"]
    # the first token seen for the first time at an output index that does not end a step
    # (steps end at indices 0, 5, 10, ...: the prefill's token, then 5 a step)
    at = next(i for i, t in enumerate(tokens) if i % 5 and i > 1 and t not in tokens[:i])
    engine = make_engine(draft=tiny_family["target"], adaptive_k=False)
    engine.add_request("spec", [5, 6, 7, 8], SamplingParams(**params, stop_token_ids=[tokens[at]]),
                       RequestOptions("speculative", k_max=4))
    outs, finals = run_all(engine)
    final = finals["spec"]
    assert outs["spec"] == tokens[:at + 1] and final.finish_reason == FinishReason.STOP
    assert engine.metrics.data.num_emitted_tokens > final.num_output_tokens, "no token was cut"
    assert final.num_speculative_tokens == final.num_output_tokens == at + 1
