"""engine.step_cost: the step-cost models and the one step-time formula."""

import json
import random
import subprocess
import sys

import pytest

from engine.hardware import GPUS, MODELS, RooflineStepCost
from engine.step_cost import LinearCost, LinearStepCost, price_step, step_parts, step_s

LINEAR = LinearStepCost(LinearCost(20e-3, 1e-5, 2e-5, 1e-8), LinearCost(3e-3, 1e-6, 2e-6, 1e-9))
ROOFLINE = RooflineStepCost(GPUS["A100-80GB"], MODELS["Llama-2-70B"], MODELS["Llama-2-7B"], tp=4,
                            draft_tp=1)


def test_import_is_pure_python():
    code = ("import sys, engine.step_cost, engine.calibration, engine.k_rule, engine.kv_rules, "
            "engine.hardware, cluster.sim.replica, router.policy, router.stats; "
            "print(any(m in sys.modules for m in ('torch', 'ray', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_linear_step_cost_round_trips_as_json():
    cost = LinearStepCost(LinearCost(1e-2, 2e-4, 5e-4, 1e-7), LinearCost(1e-3, 1e-5, 2e-5))
    again = LinearStepCost.from_dict(json.loads(json.dumps(cost.to_dict())))
    assert again == cost
    assert again.target_s(4, 8, 100) == pytest.approx(1e-2 + 8e-4 + 4e-3 + 1e-5)


def test_a_step_is_its_draft_rounds_then_one_verify_forward():
    """`price_step` by hand: round j over the sequences drafting at least j tokens, each reading
    its sequences' share of the context, the first feeding what the drafts had not read."""
    ks, ctx = [3, 1, 0, 2], 400
    drafting, verify = step_parts(LINEAR, ks, 4, 4 + sum(ks), 9, ctx)
    assert verify == LINEAR.target_s(4, 10, ctx)
    assert drafting == pytest.approx(LINEAR.draft_s(3, 9, 300) + LINEAR.draft_s(2, 2, 200)
                                     + LINEAR.draft_s(1, 1, 100), rel=1e-12)
    assert price_step(LINEAR, 4, 10, [3, 2, 1], ctx, 9) == (drafting, verify)
    assert step_parts(LINEAR, [0] * 4, 4, 4, 0, ctx) == (0.0, LINEAR.target_s(4, 4, ctx))


@pytest.mark.parametrize("cost", [LINEAR, ROOFLINE], ids=["linear", "roofline"])
def test_step_s_step_parts_and_choose_k_price_a_step_alike(cost):
    """One formula: a decode step with every draft on time costs the same by `step_s`, by
    `step_parts` (the engine's and the simulator's steps as run) and by `choose_k`'s search
    (its goodput of a candidate is the expected tokens over `step_s`)."""
    from engine.k_rule import _KSearch, expected_tokens

    rng = random.Random(0)
    for _ in range(40):
        n, ctx = rng.randint(1, 12), rng.randrange(0, 40000)
        ks = [rng.randint(0, 4) for _ in range(n)]
        accs = [rng.random() for _ in range(n)]           # distinct: one group a sequence
        drafting, verify = step_parts(cost, ks, n, n + sum(ks), sum(1 for k in ks if k), ctx)
        assert step_s(ks, cost, ctx) == pytest.approx(drafting + verify, rel=1e-12)
        search = _KSearch([(a, 4, 0.0) for a in accs], cost, ctx, 0, None)
        emitted = sum(expected_tokens(a, k) for a, k in zip(accs, ks))
        assert search.rate(ks) == pytest.approx(emitted / step_s(ks, cost, ctx), rel=1e-12)
