"""The KV budget is never exceeded; speculation is dropped before anyone is preempted."""

import os
import random

from conftest import hf_greedy
from engine.sampling_params import FinishReason, RequestOptions, SamplingParams

DTYPE = os.environ.get("SPECSERVE_TEST_DTYPE", "float32")
ELEM = 4 if DTYPE in ("float32", "fp32") else 2     # KV bytes per element follow the dtype
BLOCK = 2 * 2 * 2 * 16 * ELEM * 16   # tiny target: layers x (K,V) x kv_heads x head_dim x elem x 16 tokens


def _check_accounting(engine):
    pool, sched = engine.pool, engine.scheduler
    held_t = sum(len(s.blocks) for s in sched.running + list(sched.waiting))
    held_d = sum(len(s.draft_blocks) for s in sched.running + list(sched.waiting))
    assert pool.num_free >= 0
    assert pool.used_by == {"target": held_t, "draft": held_d}
    assert pool.num_free + held_t + held_d == pool.num_blocks
    assert pool.bytes_used("target") + pool.bytes_used("draft") <= pool.budget_bytes


def test_random_arrivals_and_aborts_stay_within_budget(make_engine, hf_target):
    engine = make_engine(kv_budget_bytes=10 * BLOCK, adaptive_k=False, max_num_batched_tokens=64)
    rng = random.Random(7)
    prompts = {f"r{i}": [rng.randrange(1, 300) for _ in range(rng.randrange(3, 30))] for i in range(24)}
    pending = list(prompts)
    outs, finals, events = {}, {}, []
    step = 0
    while pending or engine.has_unfinished():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                rid = pending.pop(0)
                engine.add_request(rid, prompts[rid], SamplingParams(temperature=0, max_tokens=40,
                                   ignore_eos=True), RequestOptions("speculative", k_max=4))
        if rng.random() < 0.05 and engine.seqs:
            victim = rng.choice(sorted(engine.seqs))
            finals[victim] = engine.abort(victim)
        before = (engine.scheduler.num_spec_downgrades, engine.scheduler.num_preemptions)
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                finals[o.request_id] = o
                assert o.kv_target_bytes == 0 and o.kv_draft_bytes == 0
            else:
                held = engine.seqs[o.request_id]
                assert o.kv_target_bytes == len(held.blocks) * engine.pool.block_bytes > 0
        after = (engine.scheduler.num_spec_downgrades, engine.scheduler.num_preemptions)
        if after != before:
            events.append(("downgrade" if after[0] > before[0] else "") +
                          ("preempt" if after[1] > before[1] else ""))
        _check_accounting(engine)
        step += 1
        assert step < 5000
    assert engine.pool.num_free == engine.pool.num_blocks        # everything freed at the end
    assert engine.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    assert engine.scheduler.num_spec_downgrades > 0
    assert "downgrade" in events[0], "speculation must be dropped before the first preemption"
    # Preempted and recomputed sequences still produce the target's greedy tokens.
    assert len(finals) == len(prompts)
    for rid, out in finals.items():
        if out.finish_reason != FinishReason.ABORT and ELEM == 4:   # transformers runs fp32
            assert outs[rid] == hf_greedy(hf_target, prompts[rid], 40), rid


def test_admission_waits_for_room_and_aborts_free_at_once(make_engine):
    engine = make_engine(draft=False, kv_budget_bytes=6 * BLOCK)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", [5] * 40, params)           # 3 blocks each: 2 fit at once
    engine.step()
    assert len(engine.scheduler.running) < 4 and engine.scheduler.waiting
    used = engine.pool.num_blocks - engine.pool.num_free
    running = [s.request_id for s in engine.scheduler.running]
    out = engine.abort(running[0])
    assert out.finished and out.finish_reason == FinishReason.ABORT
    assert engine.pool.num_blocks - engine.pool.num_free < used
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == engine.pool.num_blocks
