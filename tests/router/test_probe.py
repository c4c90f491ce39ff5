"""The ingress draws `policy.probe_share` of its requests as probes (router/policy.py: a probe
speculates where its class's acceptance says drafting does not pay, so the estimate keeps
being measured). The ingress and its observer are the real ones, without Ray; the policy's
own rule is tested in tests/router/test_policy.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from router import ingress as ingress_module
from router.config import AppConfig
from router.ingress import Ingress


@pytest.mark.parametrize("share", [0.0, 0.3])
def test_the_ingress_draws_its_share_of_probes(tmp_path, monkeypatch, share):
    cfg = AppConfig.model_validate({
        "target": {"model": "/m"}, "auth": {"require_key": False, "default_plan": "standard"},
        "ledger": {"url": f"sqlite:///{tmp_path}/ledger.db", "drain_period_s": 3600},
        "policy": {"probe_share": share}})
    ingress = Ingress(cfg, SimpleNamespace())
    ingress.probe_rng.seed(5)
    seen, real = [], ingress_module.policy.choose_tier

    def spy(request, *args):
        seen.append(request.probe)
        return real(request, *args)

    monkeypatch.setattr(ingress_module.policy, "choose_tier", spy)
    body = SimpleNamespace(speculation="auto", allow_downgrade=False)
    for _ in range(3000):
        ingress._decide("auto", body, "def f(x):", 4, 16)
    assert len(seen) == 3000
    assert abs(sum(seen) / len(seen) - share) < 0.03
