"""How a tier's replicas are told to wait for work (deployments/app.py), without a cluster."""

import pytest

import engine
from deployments.app import _runtime_env
from router.config import TierModelConfig


@pytest.mark.parametrize("wait,expected", [
    ("passive", {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}),
    ("spin", {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": str(engine.SPIN_COUNT)}),
    ("brief", {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": str(engine.BRIEF_SPIN_COUNT)}),
])
def test_replicas_get_both_openmp_variables(wait, expected):
    """Both set, so a GOMP_SPINCOUNT inherited from the launcher cannot make PASSIVE spin."""
    env = _runtime_env(TierModelConfig(model="m", num_threads=2, openmp_wait=wait))["env_vars"]
    assert {k: env[k] for k in expected} == expected
    assert env["OMP_NUM_THREADS"] == "2"


def test_passive_is_the_default_and_other_values_are_refused():
    assert TierModelConfig(model="m").openmp_wait == "passive"
    with pytest.raises(ValueError):
        TierModelConfig(model="m", openmp_wait="active")


def test_a_tier_takes_dtype_auto_and_the_bench_config_loads():
    """`auto` is the engine's own default (bfloat16 where native); a tier may ask for it, and
    the HTTP benchmark's config does; a dtype the engine does not know is refused."""
    from router.config import load_config

    assert TierModelConfig(model="m", dtype="auto").dtype == "auto"
    with pytest.raises(ValueError, match="dtype must be one of"):
        TierModelConfig(model="m", dtype="int8")
    from pathlib import Path

    cfg = load_config(Path(__file__).parents[2] / "cluster/configs/bench-http.yaml", "/nowhere/family")
    assert cfg.target.dtype == "auto" and cfg.target.openmp_wait == "brief"


@pytest.mark.parametrize("cpus,threads,expected", [
    (0.5, "auto", 1), (1, "auto", 1), (3, "auto", 3), (2.5, "auto", 2), (1, 2, 2)])
def test_auto_threads_are_the_cpus_the_rank_reserves(cpus, threads, expected):
    """The replica's OpenMP variables, its torch threads and its engine all get one count:
    with `auto`, the CPUs Ray reserves for the rank (at least one)."""
    tier = TierModelConfig(model="m", num_cpus_per_rank=cpus, num_threads=threads)
    assert tier.threads == expected
    assert tier.engine_config().num_threads == expected
    env = _runtime_env(tier)["env_vars"]
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == str(expected)


def test_auto_is_the_default_and_other_thread_counts_are_refused():
    assert TierModelConfig(model="m").num_threads == "auto"
    for bad in (0, "many", -1):
        with pytest.raises(ValueError):
            TierModelConfig(model="m", num_threads=bad)
