"""The vLLM peer (cluster/bench/peer.py): driven one batch at a time, its table compares with
the faster vLLM dtype per cell."""

import sys
from types import SimpleNamespace

import pytest

from cluster.bench import peer as peer_mod
from cluster.bench.peer import best_of


def test_best_of_takes_the_faster_dtype_per_batch_and_configuration():
    by_dtype = {
        "float32": {"version": "x", "baseline": {"1": 14.0, "32": 565.0},
                    "speculative": {"1": 100.0, "32": 550.0}},
        "bfloat16": {"version": "x", "baseline": {"1": 38.0, "32": 157.0},
                     "speculative": {"1": 42.0, "32": 112.0}},
    }
    r = best_of(by_dtype, [1, 32])
    assert r["baseline"] == {"1": 38.0, "32": 565.0}
    assert r["speculative"] == {"1": 100.0, "32": 550.0}
    assert r["best_dtype"] == {"baseline": {"1": "bfloat16", "32": "float32"},
                               "speculative": {"1": "float32", "32": "float32"}}
    assert r["by_dtype"] is by_dtype


CHILD = '''
import json, sys
job = json.load(open(sys.argv[1]))
print("INFO a log line before the models are up", flush=True)
if job["dtype"] == "broken":
    sys.exit(3)
print("READY " + json.dumps({"version": "stand-in"}), flush=True)
for i, line in enumerate(sys.stdin):
    b = json.loads(line)["batch"]
    print("WARNING a log line between runs", flush=True)
    t = 1000.0 * job.get("temperature", 0.0)         # shows which temperature the child ran at
    out = {"baseline": 10.0 * b + i + t, "speculative": 20.0 * b + i + t}
    print("RESULT " + json.dumps(out), flush=True)
'''


def _args(tmp_path, dtypes, **kw):
    return SimpleNamespace(peer_python=sys.executable, family=str(tmp_path), new_tokens=8,
                           threads=1, device="cpu", peer_spec_tokens=4, repeats=3,
                           peer_dtype=dtypes, **kw)


def test_the_peer_runs_one_batch_at_a_time_between_its_log_lines(tmp_path, monkeypatch):
    """The vLLM child is driven one batch at a time (so the sweep interleaves it with our
    runs), its log lines are skipped, and each cell is the median of its runs. A stand-in child
    speaks the protocol: vLLM itself is not installed where the tests run."""
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    monkeypatch.setattr(peer_mod, "CHILD", child)
    monkeypatch.setattr(peer_mod, "IDLE_S", 0.0)
    p = peer_mod.Peer(_args(tmp_path, "bfloat16,float32"), [[1, 2, 3]], [1, 4])
    for b in (1, 4):
        for _ in range(3):
            p.run(b)
    p.close()
    r = p.result()
    assert r["version"] == "stand-in" and r["settings"]["interleaved"]
    assert r["baseline"] == {"1": 11.0, "4": 44.0} and r["speculative"] == {"1": 21.0, "4": 84.0}
    assert r["by_dtype"]["float32"]["runs"]["speculative"]["4"] == [83.0, 84.0, 85.0]
    with pytest.raises(SystemExit, match="exit 3"):
        peer_mod.Peer(_args(tmp_path, "broken"), [[1, 2, 3]], [1])


def test_no_peer_dtype_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="peer-dtype"):
        peer_mod.Peer(_args(tmp_path, " , "), [[1, 2, 3]], [1])


def test_the_peer_samples_at_the_sweeps_temperature(tmp_path, monkeypatch):
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    monkeypatch.setattr(peer_mod, "CHILD", child)
    monkeypatch.setattr(peer_mod, "IDLE_S", 0.0)
    p = peer_mod.Peer(_args(tmp_path, "float32", temperature=1.0), [[1, 2, 3]], [1])
    p.run(1)
    p.close()
    r = p.result()
    assert r["settings"]["temperature"] == 1.0 and r["baseline"] == {"1": 1010.0}


@pytest.mark.parametrize("temperature, sweep_only",
                         [(-0.5, True), (1.0, False), (150.0, True), (float("nan"), True)])
def test_bench_engine_refuses_a_temperature_it_cannot_compare(temperature, sweep_only):
    from cluster.bench.engine import run

    args = SimpleNamespace(threads=1, quick=False, temperature=temperature, sweep_only=sweep_only)
    with pytest.raises(SystemExit, match="--temperature"):
        run(args)
