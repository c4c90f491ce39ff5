"""What `Scheduler.schedule` decides, seen through the engine: how many drafts a sequence may
propose, and how a step of prompts alone makes room under memory pressure."""

import pytest

from conftest import run_all
from engine.sampling_params import FinishReason, RequestOptions, SamplingParams

from test_memory import BLOCK, _check_accounting


def _recording(engine) -> list[dict]:
    """Every step's schedule: (request id, k, output tokens so far, tokens so far) per decode
    item, whether the step ran prompts alone, and the running sequences left out of the step
    that it downgraded or preempted to make room."""
    seen, sched = [], engine.scheduler
    schedule = sched.schedule

    def record():
        before = {s: s.speculative for s in sched.running}
        items = schedule()
        out = before.keys() - {it.seq for it in items}
        seen.append({"decodes": [(it.seq.request_id, it.k, it.seq.num_output,
                                  len(it.seq.token_ids)) for it in items if not it.prefill_align],
                     "alone": sched.last_alone,
                     "downgraded": {s.request_id for s in out if before[s] and not s.speculative
                                    and s in sched.running},
                     "preempted": {s.request_id for s in out if s not in sched.running}})
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


@pytest.mark.parametrize("evicts", ["drafts", "sequences"])
def test_prompts_alone_make_room_under_memory_pressure(make_engine, evicts):
    """prefill_mode "alone" with a KV budget too small for a long prompt's chunks and the
    decoding batch together: a step of prompt chunks alone makes room by downgrading or
    preempting sequences that sit it out, as "mixed" does with the sequences in its step.
    "drafts": the decoding batch speculates and the long prompt, arriving last, is the first to
    be preempted, so the others give up their drafts; "sequences": the batch decodes plainly
    and the long prompt has a higher priority, so the others are preempted for it. Either way
    the budget is kept, every block comes back, and the greedy tokens are those of "mixed".

    Breaks when the memory loop of `schedule` looks up an item for every victim: the decoding
    sequences sitting out the step have none, so `items[id(s)]` in the speculation victims'
    filter or on downgrade ("drafts"), or `del items[id(victim)]` after a preemption
    ("sequences"), raises KeyError from `schedule`, outside the step's fault handling: the
    engine loop dies."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    if evicts == "drafts":
        batch, prompt, priority = RequestOptions("speculative", k_max=4), [7, 9, 11], 0
        blocks, long = 10, 90
    else:
        batch, prompt, priority = RequestOptions("baseline"), [7, 9, 11, 13] * 8, 1
        blocks, long = 8, 70      # 70 + 48 tokens: the pool holds the long request alone
    arrivals = {0: [(f"s{i}", [5 + i] + prompt, params, batch) for i in range(3)],
                2: [("long", [(3 * i) % 200 + 1 for i in range(long)], params,
                     RequestOptions("speculative", k_max=4, priority=priority))]}
    outs, seen = {}, {}
    for mode in ("mixed", "alone"):
        engine = make_engine(kv_budget_bytes=blocks * BLOCK, adaptive_k=False,
                             max_num_batched_tokens=32, prefill_mode=mode)
        seen[mode] = _recording(engine)
        pending, step, outs[mode] = dict(arrivals), 0, {}
        while engine.has_unfinished() or pending:
            for args in pending.pop(step, []):
                engine.add_request(*args)
            for o in engine.step():
                outs[mode].setdefault(o.request_id, []).extend(o.token_ids)
            _check_accounting(engine)
            step += 1
        assert engine.pool.num_free == engine.pool.num_blocks
    kind = {"drafts": "downgraded", "sequences": "preempted"}[evicts]
    assert any(s["alone"] and s[kind] for s in seen["alone"]), \
        f"no step of prompts alone {kind} a sequence sitting it out"
    assert outs["alone"] == outs["mixed"] and all(len(v) == 48 for v in outs["alone"].values())
