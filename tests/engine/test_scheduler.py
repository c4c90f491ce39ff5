"""What `Scheduler.schedule` decides, seen through the engine: how many drafts a sequence may
propose."""

from conftest import run_all
from engine.sampling_params import FinishReason, RequestOptions, SamplingParams


def _recording(engine) -> list[dict]:
    """Every step's schedule: (request id, k, output tokens so far, tokens so far) per decode
    item."""
    seen, sched = [], engine.scheduler
    schedule = sched.schedule

    def record():
        items = schedule()
        seen.append({"decodes": [(it.seq.request_id, it.k, it.seq.num_output,
                                  len(it.seq.token_ids)) for it in items if not it.prefill_align]})
        return items

    sched.schedule = record
    return seen


def test_k_is_capped_by_the_tokens_a_request_may_still_emit(make_engine):
    """A step emits at most k + 1 tokens, so a sequence drafts at most as many tokens as it may
    still emit after the step's own one: k <= max_tokens - output - 1 and, by the context,
    k <= max_model_len - tokens - 1. With adaptive k off, k is exactly that room (capped by
    k_max), for a request near its max_tokens and one near the end of the context.

    Breaks when `schedule` drops the max_tokens term from a sequence's room: the output is the
    same (the extra tokens are cut at max_tokens), but the wasted drafts, verify rows and KV
    blocks make for needless downgrades and preemptions. Breaks as well without the
    max_model_len term."""
    engine = make_engine(adaptive_k=False, max_model_len=40)
    spec = RequestOptions("speculative", k_max=4)
    engine.add_request("few", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=7,
                       ignore_eos=True), spec)
    engine.add_request("long", list(range(10, 40)), SamplingParams(temperature=0, max_tokens=100,
                       ignore_eos=True), spec)
    seen = _recording(engine)
    outs, finals = run_all(engine)
    limits = {"few": (7, 40), "long": (100, 40)}
    capped = set()
    for step in seen:
        for rid, k, num_output, num_tokens in step["decodes"]:
            max_tokens, max_model_len = limits[rid]
            room = min(max_tokens - num_output - 1, max_model_len - num_tokens - 1)
            assert k == max(0, min(4, room)), (rid, k, num_output, num_tokens)
            if room < 4:
                capped.add(rid)
    assert capped == {"few", "long"}
    assert len(outs["few"]) == 7 and len(outs["long"]) == 10
    assert finals["long"].finish_reason == FinishReason.LENGTH
