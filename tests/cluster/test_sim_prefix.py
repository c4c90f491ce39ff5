"""The simulator's prefix caching: conversations that resend their history, the cache's
entries and their eviction, and what caching does to a replica's time to first token and memory."""

from dataclasses import replace

import pytest

from cluster.sim.prefix import PrefixCache
from cluster.sim.replica import Replica, build_replicas
from cluster.sim.scenarios import SCENARIOS, Workload, fixed_mix, make_request
from cluster.sim.simulator import simulate

CHAT = Workload(prompt_median=100, output_median=60, system_prompt_tokens=600, turns=4,
                requests=96)
MIX = fixed_mix(0.7)


def test_single_requests_are_unchanged_and_conversations_resend_their_history():
    plain = Workload()
    for index in range(6):
        spec = make_request(plain, MIX, 0, 3, index, 4096)
        assert spec.prefix == ()
        sys_only = make_request(replace(plain, system_prompt_tokens=500), MIX, 0, 3, index, 4096)
        assert sys_only.prompt_tokens == min(500 + spec.prompt_tokens, 4096 - spec.max_tokens)
        assert sys_only.prefix == (("system", 500),)
    turns = [make_request(CHAT, MIX, 0, 3, i, 4096) for i in range(8)]
    for before, after in zip(turns, turns[1:]):
        if after.index % CHAT.turns:   # the same conversation: its prompt starts with the last
            assert after.prefix[1][0] == before.prefix[1][0]
            assert after.prompt_tokens > before.prompt_tokens + before.output_tokens
        else:                          # a new conversation: only the system prompt is shared
            assert after.prefix[1][0] != before.prefix[1][0]
        assert after.prefix[0] == ("system", 600) and after.prefix[1][1] == after.prompt_tokens


def test_a_conversation_too_long_for_the_context_starts_again():
    specs = [make_request(replace(CHAT, turns=40), MIX, 0, 0, i, 2048) for i in range(40)]
    keys = {s.prefix[1][0] for s in specs}
    assert len(keys) > 1
    assert all(s.prompt_tokens + s.max_tokens <= 2048 for s in specs)


def test_the_system_prompt_is_held_once_and_lookups_take_whole_units():
    cache = PrefixCache(16, 64)
    moved, keys = cache.insert((("system", 600), ("c1", 900)), 900, [])
    assert moved == 896 and keys == ["system", "c1"] and cache.held_tokens == 896
    moved, _ = cache.insert((("system", 600), ("c2", 700)), 700, [])
    assert moved == 700 // 16 * 16 - 592       # the system prompt's 592 tokens are not counted again
    assert cache.tokens == 896 + moved
    # a later turn of c1 takes the cached run in whole units of 64, short of its last token
    hit, used, unheld = cache.lookup((("system", 600), ("c1", 1500)), 1500)
    assert (hit, used, unheld) == (896 // 64 * 64, ["system", "c1"], 0)
    assert cache.lookup((("system", 600), ("c1", 897)), 897)[0] == 896 // 64 * 64
    assert cache.lookup((("system", 600), ("c3", 900)), 900)[:2] == (576, ["system"])


def test_held_entries_are_never_evicted_and_the_least_recently_used_goes_first():
    cache = PrefixCache(16, 16)
    _, a = cache.insert((("a", 160),), 160, [])
    _, b = cache.insert((("b", 320),), 320, [])
    _, c = cache.insert((("c", 480),), 480, [])
    cache.release(b)
    cache.release(a)       # a was used last: b goes first
    assert cache.evict() == 320 and "b" not in cache.entries
    assert cache.evict() == 160 and cache.evict() == 0      # c is held
    assert cache.tokens == cache.held_tokens == 480


def _run(caching: bool, users: int, memory_gib=None):
    dep = replace(SCENARIOS["seed-4xa100"].deployment, prefix_caching=caching)
    target, small = build_replicas(dep, "sharded", "baseline", 4)
    if memory_gib is not None:
        target = replace(target, gpu_bytes=[f + memory_gib * 2**30 for f in target.fixed_bytes])
    return simulate(target, small, "baseline", CHAT, MIX, users, seed=1, max_context=dep.max_context)


@pytest.mark.parametrize("users", [2, 16])
def test_caching_cuts_time_to_first_token_on_conversations(users):
    off, on = _run(False, users), _run(True, users)
    def ttft_p50(run):   # of the turns after a conversation's first
        ttft = sorted(s.first_token_s - s.arrival_s for s in run.seqs if s.spec.index % CHAT.turns)
        return ttft[len(ttft) // 2]
    assert ttft_p50(off) >= 2 * ttft_p50(on)
    assert on.row()["throughput_tok_s"] >= off.row()["throughput_tok_s"]
    assert on.prefix_hit_rate > 0.5 and off.prefix_hit_rate is None


def _memory_holds(replica: Replica) -> None:
    """Per GPU: weights, what sequences hold and every cache entry fit the device; the held
    count is what running sequences hold."""
    c, cache = replica.cfg, replica.cache
    for f, u, t, m in zip(c.fixed_bytes, replica.used, c.target_kv, c.gpu_bytes):
        assert f + u + t * cache.tokens <= m * (1 + 1e-9)
    holders = {}
    for s in replica.running:
        for key in s.cache_keys:
            holders[key] = holders.get(key, 0) + 1
    assert {k: e.holders for k, e in cache.entries.items() if e.holders} == holders
    assert cache.held_tokens == sum(e.tokens - e.base for e in cache.entries.values() if e.holders)


def test_a_full_cache_is_evicted_rather_than_anyone_waiting(monkeypatch):
    """Memory for a few conversations only: the cache fills it, then gives it up to new
    requests; nobody waits longer or is preempted more than without a cache. Memory is
    checked after every step."""
    evicted, step, evict = [], Replica.apply_step, PrefixCache.evict

    def checked_step(self, *args):
        out = step(self, *args)
        _memory_holds(self)
        return out

    def counted_evict(self):
        evicted.append(evict(self))
        return evicted[-1]
    monkeypatch.setattr(Replica, "apply_step", checked_step)
    monkeypatch.setattr(PrefixCache, "evict", counted_evict)
    on = _run(True, 8, memory_gib=0.5)
    monkeypatch.undo()
    off = _run(False, 8, memory_gib=0.5)
    assert sum(evicted) > 0
    assert on.row()["refused"] == off.row()["refused"] == 0
    assert on.row()["p95_queue_s"] <= off.row()["p95_queue_s"] + 1e-9
    assert on.row()["preemptions"] <= off.row()["preemptions"]
