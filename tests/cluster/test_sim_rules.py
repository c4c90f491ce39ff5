"""The simulator's replicas and the engine's scheduler apply one set of memory rules
(`engine/kv_rules.py`): changing a rule there changes both sides' choice alike.

Each test sets up the same situation on both sides, the engine's `Scheduler` in KV blocks and
a simulated `Replica` in bytes, and compares their choices under the real rule and under a
changed one."""

import pytest
import torch

from cluster.sim.replica import Replica, ReplicaConfig, Seq
from cluster.sim.scenarios import RequestSpec
from engine import kv_rules
from engine.kv_cache import BlockPool
from engine.sampling_params import Mode, RequestOptions, SamplingParams
from engine.scheduler import Scheduler, SchedulerLimits
from engine.sequence import Sequence, Status
from engine.step_cost import LinearCost, LinearStepCost

COST = LinearStepCost(LinearCost(20e-3, 0.0, 0.0), LinearCost(3e-3, 0.0, 0.0))
PROMPT = 16           # one block of 16 tokens on both sides (a block holds 16 draft tokens too)


def _scheduler(num_blocks: int) -> Scheduler:
    pool = BlockPool(0, (1, 1, 8), 16, torch.float32, "cpu", draft=(1, 1, 8), num_blocks=num_blocks)
    assert pool.target.tokens_per_block == pool.draft.tokens_per_block == 16
    return Scheduler(pool, SchedulerLimits(), lambda acc, room, *rest: list(room), lambda s: 0.7)


def _engine_seq(i: int, speculative: bool) -> Sequence:
    mode = Mode.SPECULATIVE if speculative else Mode.BASELINE
    return Sequence(f"r{i}", [1] * PROMPT, SamplingParams(max_tokens=32),
                    RequestOptions(mode=mode, k_max=4), arrival=float(i + 1))


def _replica(memory: float) -> Replica:
    # fixed_k: every speculative sequence drafts 4, as the engine's scheduler above chooses
    return Replica(ReplicaConfig(COST, [memory], [0.0], [1.0], [1.0], fixed_k=4,
                                 engine_downgrade=True))


def _sim_seq(i: int, speculative: bool) -> Seq:
    seq = Seq(RequestSpec(0, i, PROMPT, 32, 32, "code", 0.7, 0.0, i), arrival_s=float(i + 1))
    seq.speculative, seq.k_cap, seq.tier = speculative, 4 if speculative else 0, "speculative"
    return seq


def _engine_yields(speculative: bool) -> tuple[list[int], list[int]]:
    """Three sequences decoding after a prompt of one block, each holding that block, and a
    step that needs more than is free: (indices dropped to baseline, indices preempted)."""
    sched = _scheduler(10 if speculative else 5)
    for i in range(3):
        seq = _engine_seq(i, speculative)
        seq.token_ids.append(1)
        seq.num_computed, seq.status = PROMPT, Status.RUNNING
        seq.blocks = sched.pool.allocate(1, "target")
        sched.running.append(seq)
    # speculative, k = 4: a target block and two draft blocks each (9), 7 free; baseline: a
    # target block each (3), 2 free. Either way one sequence must yield.
    sched.schedule()
    index = lambda s: int(s.request_id[1:])   # noqa: E731
    return ([index(s) for s in sched.running if speculative and not s.speculative],
            [index(s) for s in sched.waiting])


def _sim_yields(speculative: bool) -> tuple[list[int], list[int]]:
    """The same on a simulated replica, in bytes (a token of target or draft KV: one byte)."""
    replica = _replica(160.0 if speculative else 80.0)
    for i in range(3):
        seq = _sim_seq(i, speculative)
        seq.prefill_left, seq.computed, seq.emitted = 0, PROMPT, 1
        replica._hold(seq, PROMPT, speculative)
        replica.running.append(seq)
    # speculative: 96 bytes held, 96 more needed, 64 free; baseline: 48 held, 48 more, 32 free
    replica.plan_step()
    return ([s.spec.index for s in replica.running if speculative and not s.speculative],
            [s.spec.index for s in replica.waiting])


@pytest.mark.parametrize("speculative", [True, False], ids=["drops-speculation", "preempts"])
@pytest.mark.parametrize("order", ["engine", "oldest-first"])
def test_both_sides_choose_the_same_victim_by_the_shared_victim_order(monkeypatch, speculative, order):
    if order == "oldest-first":
        monkeypatch.setattr(kv_rules, "victim_order",
                            lambda seqs, priority, arrival: sorted(seqs, key=arrival))
    victim = 2 if order == "engine" else 0          # the latest arrival, or the changed rule's
    want = ([victim], []) if speculative else ([], [victim])
    assert _engine_yields(speculative) == want
    assert _sim_yields(speculative) == want


def _engine_admits() -> tuple[bool, bool]:
    """One speculative request into an empty engine: (admitted, still speculative)."""
    sched = _scheduler(10)
    seq = _engine_seq(0, True)
    sched.add(seq)
    sched.schedule()
    return seq in sched.running, seq.speculative


def _sim_admits() -> tuple[bool, bool]:
    replica = _replica(1e6)
    seq = _sim_seq(0, True)
    replica.waiting.append(seq)
    replica.admit(0.0, 60.0)
    return seq in replica.running, seq.speculative


@pytest.mark.parametrize("changed,want", [
    (None, (True, True)),
    ("keeps_speculation", (True, False)),     # admitted, as baseline
    ("fits_beside_growth", (False, True)),    # waits
])
def test_both_sides_admit_by_the_shared_admission_test_and_downgrade_threshold(monkeypatch, changed, want):
    if changed:
        monkeypatch.setattr(kv_rules, changed, lambda *args, **kwargs: False)
    assert _engine_admits() == want
    assert _sim_admits() == want


def test_both_sides_take_the_same_downgrade_threshold(monkeypatch):
    """The headroom below which a request is admitted as baseline has one value: the engine's
    limit defaults to it and the simulator passes nothing else."""
    seen = {}
    real = kv_rules.keeps_speculation

    def spy(free_after, budget, min_free_fraction=kv_rules.SPEC_MIN_FREE_FRACTION):
        seen[side] = min_free_fraction
        return real(free_after, budget, min_free_fraction)

    monkeypatch.setattr(kv_rules, "keeps_speculation", spy)
    side = "engine"
    _engine_admits()
    side = "simulator"
    _sim_admits()
    assert seen == {"engine": kv_rules.SPEC_MIN_FREE_FRACTION, "simulator": kv_rules.SPEC_MIN_FREE_FRACTION}
    assert SchedulerLimits().spec_min_free_fraction == kv_rules.SPEC_MIN_FREE_FRACTION


PREFIX = 128          # tokens both sides hold cached for the second prompt


def _engine_takes_cached(prompt: int) -> int:
    """A first prompt of PREFIX tokens computed, keyed and let go; a second prompt of `prompt`
    tokens that starts with it: the tokens it takes from the cache."""
    from engine.prefix_cache import chain_keys

    sched = _scheduler(32)
    tokens = list(range(1, prompt + 1))
    blocks = sched.pool.allocate(PREFIX // 16, "target")
    for block, key in zip(blocks, chain_keys(tokens, 16, b"target", [], PREFIX // 16)):
        sched.pool.cache.register(block, key)
    sched.pool.free(blocks, "target")
    seq = Sequence("r", tokens, SamplingParams(max_tokens=8), RequestOptions(mode=Mode.BASELINE))
    sched.add(seq)
    sched.schedule()
    assert seq in sched.running
    return seq.num_computed


def _sim_takes_cached(prompt: int) -> int:
    from cluster.sim.prefix import PrefixCache

    replica = _replica(1e6)
    replica.cache = PrefixCache(16, kv_rules.prefix_unit(16, SchedulerLimits().prefill_align))
    replica.cache.insert((("conversation", PREFIX),), PREFIX, [])
    replica.cache.release(["conversation"])
    seq = Seq(RequestSpec(0, 0, prompt, 8, 8, "code", 0.7, 0.0, 0, (("conversation", prompt),)),
              arrival_s=1.0)
    replica.waiting.append(seq)
    replica.admit(0.0, 60.0)
    assert seq in replica.running
    return seq.computed


@pytest.mark.parametrize("changed", [False, True])
@pytest.mark.parametrize("prompt", [PREFIX, PREFIX + 1, PREFIX + 40])
def test_both_sides_take_the_same_cached_prefix(monkeypatch, changed, prompt):
    """The tokens a prompt takes from the prefix cache follow `kv_rules.reusable_prefix` and
    `kv_rules.prefix_unit` on both sides; a changed rule changes both alike."""
    if changed:   # one unit less than the rule allows
        real = kv_rules.reusable_prefix
        monkeypatch.setattr(kv_rules, "reusable_prefix",
                            lambda p, c, u: max(real(p, c, u) - u, 0))
    engine, sim = _engine_takes_cached(prompt), _sim_takes_cached(prompt)
    assert engine == sim
    unit = kv_rules.prefix_unit(16, SchedulerLimits().prefill_align)
    assert engine == max(min(PREFIX, prompt - 1) // unit * unit - (unit if changed else 0), 0)
