"""engine.kv_rules: the scheduler's memory rules, as pure functions (both sides applying them:
tests/cluster/test_sim_rules.py)."""

from types import SimpleNamespace

from engine import kv_rules


def test_blocks_needed_rounds_up():
    assert [kv_rules.blocks_needed(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_a_prompt_is_admitted_beside_one_growth_block_per_running_sequence():
    assert kv_rules.fits_beside_growth(need=4, free=10, num_running=6, growth_block=1)
    assert not kv_rules.fits_beside_growth(need=5, free=10, num_running=6, growth_block=1)
    assert kv_rules.fits_beside_growth(need=400.0, free=1000.0, num_running=3, growth_block=200.0)
    assert not kv_rules.fits_beside_growth(need=401.0, free=1000.0, num_running=3, growth_block=200.0)


def test_a_speculative_request_keeps_speculation_down_to_the_threshold():
    frac = kv_rules.SPEC_MIN_FREE_FRACTION
    assert kv_rules.keeps_speculation(frac * 100, 100)
    assert not kv_rules.keeps_speculation(frac * 100 - 1, 100)
    assert kv_rules.keeps_speculation(30, 100, min_free_fraction=0.3)


def _seqs(*specs):
    return [SimpleNamespace(name=n, priority=p, arrival=a, spec=s) for n, p, a, s in specs]


def _victim(seqs):
    victim, drops = kv_rules.next_victim(seqs, lambda s: s.priority, lambda s: s.arrival,
                                         lambda s: s.spec)
    return victim.name, drops


def test_lowest_priority_yields_first_and_among_equals_the_latest_arrival():
    seqs = _seqs(("a", 0, 1.0, False), ("b", 1, 3.0, False), ("c", 0, 2.0, False), ("d", 0, 0.5, False))
    order = kv_rules.victim_order(seqs, lambda s: s.priority, lambda s: s.arrival)
    assert [s.name for s in order] == ["c", "a", "d", "b"]


def test_speculation_is_dropped_before_anyone_is_preempted():
    assert _victim(_seqs(("a", 0, 1.0, False), ("b", 1, 2.0, True), ("c", 0, 3.0, False))) == ("b", True)
    assert _victim(_seqs(("a", 0, 1.0, True), ("b", 0, 2.0, True))) == ("b", True)
    assert _victim(_seqs(("a", 0, 1.0, False), ("b", 0, 2.0, False))) == ("b", False)
