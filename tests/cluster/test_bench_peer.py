"""The vLLM peer's table compares with the faster vLLM dtype per cell (cluster/bench/peer.py)."""

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
