"""Prefix caching: output unchanged, cached blocks evicted before anyone waits, held blocks
never evicted, every hold released (docs/decisions/0028-prefix-caching.md)."""

import os
import random

import pytest
import torch

from conftest import run_all
from engine.kv_cache import BlockPool
from engine.prefix_cache import chain_keys
from engine.sampling_params import RequestOptions, SamplingParams

N_NEW = 12
ELEM = 4 if os.environ.get("SPECSERVE_TEST_DTYPE", "float32") in ("float32", "fp32") else 2
BLOCK = 2 * 2 * 2 * 16 * ELEM * 16   # tiny target: layers x (K,V) x kv_heads x head_dim x 16 tokens
RNG = random.Random(3)
BASE = [RNG.randrange(5, 300) for _ in range(200)]


def _params(n=N_NEW):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _check_holds(engine):
    """Every block's refcount is the number of live sequences holding it, the budget counts a
    held block once, and a block is free, kept (unheld, keyed) or held: never two of these."""
    pool, sched = engine.pool, engine.scheduler
    seqs = sched.running + list(sched.waiting)
    holds = [0] * pool.num_blocks
    for s in seqs:
        for b in s.blocks + s.draft_blocks:
            holds[b] += 1
    assert pool.refs == holds
    held = sum(h > 0 for h in holds)
    assert pool.used_by["target"] + pool.used_by["draft"] == held
    assert pool.num_free + held == pool.num_blocks
    assert pool.num_empty + pool.cache.num_evictable + held == pool.num_blocks


def _run_one_at_a_time(engine, prompts, mode):
    outs = []
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, _params(), RequestOptions(mode=mode, k_max=3))
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == f"r{i}":
                    outs.append(o.token_ids) if len(outs) == i else outs[i].extend(o.token_ids)
            _check_holds(engine)
    return outs


@pytest.mark.parametrize("mode", ["baseline", "speculative"])
def test_greedy_output_is_the_same_with_the_cache(make_engine, mode):
    """Prompts sharing prefixes of a block multiple, of none, a prompt sent twice whole and one
    that is a prefix of another: token for token the output without the cache, with the hits
    the rule gives (whole `prefix_unit`s, never the last prompt token)."""
    prompts = [BASE, BASE[:64] + [7] * 20, BASE[:150] + [9, 8, 7], BASE, BASE[:128],
               BASE[:100] + [5] * 60, [3] + BASE[1:180]]
    kw = dict(max_num_batched_tokens=256, adaptive_k=False)    # prefill_align 64: 4 blocks
    off = _run_one_at_a_time(make_engine(enable_prefix_caching=False, **kw), prompts, mode)
    engine = make_engine(**kw)
    on = _run_one_at_a_time(engine, prompts, mode)
    assert on == off
    unit = engine.scheduler.prefix_unit
    hits = [0] + [min(shared, len(p) - 1) // unit * unit for shared, p in
                  zip([64, 150, 200, 128, 100, 0], prompts[1:])]
    stats = engine.stats()
    assert stats.prefix_cache_hits == sum(hits) > 0
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    if mode == "speculative":
        assert engine.snapshot().num_accepted_tokens > 0
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_concurrent_batch_with_shared_prefixes_matches(make_engine):
    """Requests arriving while others with the same prefix still prefill or decode (siblings
    of one prompt among them), speculative and baseline mixed, under a budget that preempts."""
    prompts = [BASE[:40 + 20 * (i % 7)] + [11 + i] * (i % 3) for i in range(14)]
    prompts += [BASE[:120]] * 3
    arrivals = {}
    for i, p in enumerate(prompts):
        mode = "speculative" if i % 2 else "baseline"
        arrivals.setdefault(i // 3, []).append((f"r{i}", p, _params(24),
                                                RequestOptions(mode=mode, k_max=1 + i % 4)))
    kw = dict(max_num_batched_tokens=64, adaptive_k=False, kv_budget_bytes=1 << 20)
    off, _ = run_all(make_engine(enable_prefix_caching=False, **kw), dict(arrivals))
    engine = make_engine(**kw)
    on, _ = run_all(engine, dict(arrivals))
    assert on == off
    assert engine.stats().prefix_cache_hits > 0
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.pool.refs == [0] * engine.pool.num_blocks


def test_cached_blocks_are_evicted_rather_than_anyone_waiting(make_engine):
    """A pool full of kept blocks that nobody holds: a new batch that needs more than the
    empty blocks is admitted at once, evicting the least recently used, with no preemption."""
    engine = make_engine(draft=False, max_num_batched_tokens=256, kv_budget_bytes=40 * BLOCK)
    pool, tpb = engine.pool, engine.pool.target.tokens_per_block
    rng = random.Random(5)
    old = [[rng.randrange(5, 300) for _ in range(70)] for _ in range(8)]
    for i, p in enumerate(old):              # distinct prompts fill the pool with kept blocks
        engine.add_request(f"w{i}", p, _params(2))
        run_all(engine)
    keys = [chain_keys(p, tpb, b"target", [], len(p) // tpb) for p in old]
    assert all(pool.cache.lookup(k) for k in keys)
    assert pool.cache.num_evictable > pool.num_empty
    assert pool.num_free == pool.num_blocks
    fresh = [[rng.randrange(5, 300) for _ in range(60)] for _ in range(3)]
    need = sum(-(-(len(p) + 1) // pool.target.tokens_per_block) for p in fresh)
    assert need > pool.num_empty
    for i, p in enumerate(fresh):
        engine.add_request(f"n{i}", p, _params(4))
    engine.step()
    assert not engine.scheduler.waiting and len(engine.scheduler.running) == 3
    _check_holds(engine)
    run_all(engine)
    assert engine.scheduler.num_preemptions == 0
    assert not pool.cache.lookup(keys[0])       # the oldest prompt's blocks went first
    assert pool.cache.lookup(keys[-1])          # the newest stayed


def test_a_held_block_is_never_evicted_and_lru_goes_first():
    pool = BlockPool(0, (2, 2, 16), 16, torch.float32, "cpu", num_blocks=8)
    blocks = pool.allocate(8, "target")
    keys = chain_keys(list(range(8 * 16)), 16, b"target", [], 8)
    for b, k in zip(blocks, keys):
        pool.cache.register(b, k)
    pool.free(blocks[:6][::-1], "target")      # released tail first: 5, 4, ..., 0
    assert pool.num_free == 6 and pool.num_empty == 0
    pool.share([blocks[2]], "target")          # held again by another sequence
    assert pool.num_free == 5
    got = pool.allocate(2, "target")
    assert set(got) == {blocks[5], blocks[4]}   # the least recently released go first
    assert pool.cache.lookup(keys) == blocks[:4]
    got = pool.allocate(3, "target")
    assert blocks[2] not in got and set(got) == {blocks[3], blocks[1], blocks[0]}
    assert pool.cache.lookup(keys) == []       # block 0's key went: the chain is cut
    assert pool.num_free == 0 and pool.refs[blocks[2]] == 1
    with pytest.raises(Exception):
        pool.allocate(1, "target")


def test_finish_abort_and_preemption_release_every_hold(make_engine):
    """Shared prompt blocks under a budget tight enough to preempt and downgrade, with aborts:
    every step each block's refcount is its holders, and at the end nothing is held."""
    engine = make_engine(kv_budget_bytes=12 * BLOCK, adaptive_k=False, max_num_batched_tokens=64)
    rng = random.Random(11)
    step, pending = 0, [BASE[:rng.choice([48, 64, 90])] + [rng.randrange(5, 300)] * 3
                        for _ in range(16)]
    while pending or engine.has_unfinished():
        if pending and rng.random() < 0.7:
            engine.add_request(f"r{len(pending)}", pending.pop(), _params(50),
                               RequestOptions(mode="speculative", k_max=3))
        if rng.random() < 0.08 and engine.seqs:
            engine.abort(rng.choice(sorted(engine.seqs)))
        engine.step()
        _check_holds(engine)
        step += 1
        assert step < 3000
    assert engine.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    assert engine.scheduler.num_spec_downgrades > 0, "and to drop speculation"
    assert engine.stats().prefix_cache_hits > 0
    assert engine.pool.refs == [0] * engine.pool.num_blocks
    assert engine.pool.used_by == {"target": 0, "draft": 0}


def test_a_speculative_request_reuses_the_target_prefix_without_draft_kv(make_engine):
    """After a baseline request (target KV only) a speculative one with the same prompt reuses
    the target's blocks and its draft catches up over the prompt when it drafts; the next
    speculative one finds both models' blocks; a baseline request reuses the target's blocks
    whoever computed them. The greedy output is the same for all four."""
    engine = make_engine(max_num_batched_tokens=64, adaptive_k=False)
    unit = engine.scheduler.prefix_unit
    hits, outputs, draft_held = [], [], []
    for mode in ["baseline", "speculative", "speculative", "baseline"]:
        before = engine.stats().prefix_cache_hits
        rid = f"r{len(hits)}"
        engine.add_request(rid, BASE, _params(), RequestOptions(mode=mode, k_max=3))
        first = [t for o in engine.step() for t in o.token_ids]    # the prompt's rest
        draft_held.append(engine.seqs[rid].draft_computed)        # as admitted
        outputs.append(first + run_all(engine)[0][rid])
        hits.append(engine.stats().prefix_cache_hits - before)
    whole = (len(BASE) - 1) // unit * unit
    assert hits == [0, whole, whole, whole]
    draft_tpb = engine.scheduler.draft_tpb
    # the second found no draft KV; the third the draft blocks the second's catch-up computed
    assert draft_held[1] == 0 and draft_held[2] == (len(BASE) - 1) // draft_tpb * draft_tpb > 0
    assert all(o == outputs[0] for o in outputs)


def test_a_running_prompt_is_shared_and_decoded_blocks_are_not(make_engine):
    """A request arriving while another with its prompt decodes reuses that prompt's blocks at
    once; blocks a decode computed (other bits than a prefill's) are never reused, so a prompt
    that resends an answer hits only the earlier prompt's part."""
    engine = make_engine(draft=False, max_num_batched_tokens=256)
    unit = engine.scheduler.prefix_unit
    engine.add_request("a", BASE, _params(60))
    first = engine.step()[0].token_ids                  # a's whole prompt in one chunk
    engine.add_request("b", BASE[:150] + [4] * 30, _params())
    first += [t for o in engine.step() if o.request_id == "a" for t in o.token_ids]
    assert engine.stats().prefix_cache_hits == 128
    outs, _ = run_all(engine)
    before = engine.stats().prefix_cache_hits
    engine.add_request("c", BASE + first + outs["a"] + [6] * 10, _params())
    run_all(engine)
    assert engine.stats().prefix_cache_hits - before == len(BASE) // unit * unit


def test_holding_unheld_cached_blocks_counts_against_admission(make_engine):
    """A request whose cached prefix nobody holds takes those blocks out of the free count when
    it holds them: it is admitted only where its prefix and its new blocks fit together, else
    it waits (here for a running request to finish) instead of overdrawing the pool."""
    engine = make_engine(draft=False, max_num_batched_tokens=256, kv_budget_bytes=16 * BLOCK)
    pool = engine.pool
    engine.add_request("p", BASE[:160], _params(2))
    run_all(engine)                                   # 10 keyed blocks kept, 6 empty
    engine.add_request("r", [4] * 50, _params(12))    # holds 4 of the empty blocks
    engine.step()
    assert (pool.num_empty, pool.cache.num_evictable) == (2, 10)
    engine.add_request("q", BASE[:128] + [6] * 75, _params(4))   # 8 cached + 5 new blocks
    engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ["q"]
    _check_holds(engine)
    outs, _ = run_all(engine)
    assert len(outs["q"]) == 4 and engine.scheduler.num_preemptions == 0
    assert engine.stats().prefix_cache_hits == 128
