"""The step-cost profile (`engine/profiler.py`): a slow spell of the machine must not price one
point of the grid, and more work never prices lower."""

import time

from engine.profiler import REPEATS, WARMUP, _isotonic, _monotone, _time_runner

SPELL_S = 0.05          # another tenant's slow spell: this much on each forward it touches


class _SlowSpell:
    """The engine's own target runner, each forward from call `start` to `start + length`
    taking SPELL_S longer (as a neighbour on the host would make it)."""

    def __init__(self, runner, start: int, length: int):
        self.runner, self.start, self.length, self.calls = runner, start, length, 0
        self.device = runner.device

    def run(self, *args):
        self.calls += 1
        if self.start <= self.calls < self.start + self.length:
            time.sleep(SPELL_S)
        return self.runner.run(*args)


def test_a_slow_spell_prices_no_point_of_the_grid(make_engine):
    """Timed point after point, a spell as long as two points' runs would lift those two
    points by the whole spell (their medians ~SPELL_S); timed in passes over the grid it
    touches each point once or twice among WARMUP + REPEATS runs, and the medians keep the
    true forward times."""
    engine = make_engine(profile=False)
    grid = [(n, q) for n in (1, 2, 4) for q in (1, 2, 3)]
    runs = WARMUP + REPEATS
    slow = _SlowSpell(engine.target, start=2 + runs, length=2 * runs)   # after the fill forward
    samples = _time_runner(slow, engine.pool, "target", engine.pool.target.tokens_per_block, grid,
                           max_tokens=4096)
    assert slow.calls == 1 + runs * len(grid)
    assert len(samples) == len(grid)
    assert engine.pool.num_free == engine.pool.num_blocks             # every block given back
    assert max(s for *_, s in samples) < SPELL_S / 2, samples


def test_the_table_is_monotone_in_tokens_and_in_sequences():
    noisy = {(1, 1): 2.0, (1, 2): 1.6, (1, 3): 2.4, (2, 1): 1.5, (2, 2): 3.0, (2, 3): 2.9,
             (4, 1): 3.5, (4, 2): 3.4, (4, 3): 5.0}
    out = _monotone(noisy)
    for n in (1, 2, 4):
        line = [out[(n, q)] for q in (1, 2, 3)]
        assert line == sorted(line), (n, line)
    for q in (1, 2, 3):
        line = [out[(n, q)] for n in (1, 2, 4)]
        assert line == sorted(line), (q, line)
    # points already in order keep their values
    assert out[(4, 3)] == 5.0 and out[(2, 2)] >= 2.9
    # pool adjacent violators: a least-squares fit, means of the pooled runs
    assert _isotonic([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert _isotonic([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]
    assert _isotonic([]) == []


class _Counting:
    """The engine's own target runner, recording the tokens of every forward it runs."""

    def __init__(self, runner):
        self.runner, self.device, self.tokens = runner, runner.device, []

    def run(self, seqs, ids, pos, rows):
        self.tokens.append(len(ids))
        return self.runner.run(seqs, ids, pos, rows)


def test_no_profiling_forward_carries_more_than_the_step_budget(make_engine):
    """The GPU memory plan measures activations up to a step's token budget; a profiling
    forward above it (filling 32 sequences' contexts at once: 32 x 192 tokens) could run the
    device out of memory at start. Breakage that turns it red: `_fill` writing every
    sequence's context in one forward."""
    engine = make_engine(profile=False)
    counting = _Counting(engine.target)
    grid = [(n, q) for n in (1, 4, 8) for q in (1, 3)]
    _time_runner(counting, engine.pool, "target", engine.pool.target.tokens_per_block, grid,
                 max_tokens=128)
    assert max(counting.tokens) <= 128
    assert sum(counting.tokens[:-(WARMUP + REPEATS) * len(grid)]) == 8 * 192  # every context
