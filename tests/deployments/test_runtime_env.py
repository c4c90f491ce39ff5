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
