"""The closed alignment loop on the real local cluster (deployments/alignment_loop.py).

One app with the loop on, the tiny family (its draft is the target plus noise, so it accepts
often at temperature 0) and the target drafting every step. Premium traffic is never captured;
auto traffic with `speculation: on` is (`capture.plans`).
- An operator's candidate with random weights is canaried in alternating windows and rolled
  back by the loop, with no further command: it loses the class the traffic is in.
- Auto traffic then fills the capture buffer; the serving draft's acceptance is below the
  loop's threshold, so the loop starts a distillation round on its own and the round's
  candidate is judged (by the swap guard, then the canary); every step is in the history.
"""

from __future__ import annotations

import threading
import time

import pytest

from cluster.cli.draft_loop import summary
from deployments.alignment_loop import read_history
from serving_helpers import MODEL, served_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = ["def add(a, b):", "def mul(x, y):\n    return", "import os\nclass Node:"]


@pytest.fixture(scope="module")
def bad_draft(tiny_family, tmp_path_factory):
    """The draft's shape with weights of its own: it agrees with the target by chance only."""
    from transformers import AutoTokenizer

    from tiny_models import make_llama

    folder = tmp_path_factory.mktemp("bad-draft") / "draft"
    folder.mkdir()
    make_llama(folder, AutoTokenizer.from_pretrained(str(tiny_family["target"])), seed=7)
    return folder


@pytest.fixture(scope="module")
def app(tiny_family, module_tmp):
    rules = {"threshold": 0.99, "min_requests": 6, "stay_below_s": 0, "min_prompts": 12,
             "canary_requests": 6, "margin": 0.0, "loss_tolerance": 0.01}
    alignment = {"enabled": True, "rules": rules, "dir": str(module_tmp / "alignment"),
                 "period_s": 0.3, "canary_share": 0.5, "canary_window_s": 1.5,
                 "canary_timeout_s": 120, "watch_s": 5,
                 # the round at the replicas' priority: niced to 19 it waits behind the other
                 # test worker for minutes
                 "round": {"steps": 2, "minutes": None, "threads": 1, "niceness": 0, "replay": 0,
                           "new_tokens": 16, "extra_args": ["--heldout", "0.25",
                                                            "--eval-every-s", "600"]}}
    capture = {"enabled": True, "plans": ["auto"], "threshold": 1.0,
               "dir": str(module_tmp / "capture")}
    with served_app(module_tmp, tiny_family, alignment=alignment, capture=capture,
                    target={"engine_args": {"adaptive_k": False}}) as served:
        yield served


def _traffic(app, plan: str, stop: threading.Event, results: list, extra: dict) -> None:
    i, prefix = 0, "" if plan == "auto" else f"/{plan}"
    with app.client(plan) as client:
        while not stop.is_set():
            r = client.post(f"{prefix}/v1/completions",
                            json={"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)] + f" {i}",
                                  "max_tokens": 16, "temperature": 0, **extra})
            results.append(r.status_code)
            i += 1


def _until(app, events: set[str], after: int, timeout_s: float) -> list[dict]:
    """The history once a record of one of `events` follows the first `after` records."""
    deadline = time.time() + timeout_s
    folder = app.config["alignment"]["dir"]
    while time.time() < deadline:
        records = read_history(folder)
        if any(r["event"] in events for r in records[after:]):
            return records
        time.sleep(0.5)
    raise AssertionError(f"no {events} record in {timeout_s} s: {read_history(folder)}")


def _serving(app) -> str:
    return app.handle("TargetServer").draft.remote().result(timeout_s=30)["draft"]


def test_a_bad_candidate_is_rolled_back_by_the_canary(app, bad_draft):
    loop = app.handle("AlignmentLoop")
    serving = _serving(app)
    stop, results = threading.Event(), []
    threads = [threading.Thread(target=_traffic, args=(app, "premium", stop, results, {}))
               for _ in range(2)]
    for t in threads:
        t.start()
    try:
        status = loop.canary.remote(str(bad_draft), True).result(timeout_s=30)
        assert status["state"] == "canary" and status["candidate"] == str(bad_draft)
        records = _until(app, {"promote", "rollback"}, 0, 120)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    print("\n" + "\n".join(f"{r['event']} {r.get('reason', '')} {summary(r)}" for r in records))
    assert [r["event"] for r in records] == ["trigger", "canary", "rollback"]
    verdict = records[-1]
    assert verdict["reason"] == "class_lost" and verdict["prompt_class"] == "code"
    assert verdict["canary"]["code"]["acceptance"] < verdict["rest"]["code"]["acceptance"]
    assert min(verdict["canary"]["code"]["requests"], verdict["rest"]["code"]["requests"]) >= 6
    assert _serving(app) == serving                   # the serving draft is back everywhere
    assert set(results) == {200}
    assert loop.status.remote().result(timeout_s=30)["state"] == "idle"


def test_a_class_below_the_threshold_starts_a_round_on_its_own(app):
    before = len(read_history(app.config["alignment"]["dir"]))
    stop, results = threading.Event(), []
    threads = [threading.Thread(target=_traffic, args=(app, "auto", stop, results,
                                                       {"speculation": "on"}))
               for _ in range(2)]
    for t in threads:
        t.start()
    try:
        records = _until(app, {"round"}, before, 240)
        records = _until(app, {"promote", "rollback"}, len(records) - 1, 180)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    new = records[before:]
    print("\n" + "\n".join(f"{r['event']} {r.get('reason', '')} {summary(r)}" for r in new))
    trig, rnd = new[0], new[1]
    assert trig["event"] == "trigger" and trig["reason"] == "class_below_threshold"
    assert trig["prompt_class"] == "code" and trig["live"]["code"]["acceptance"] < 0.99
    assert trig["captured"]["code"] >= 12
    assert rnd["event"] == "round" and rnd["returncode"] == 0 and rnd["heldout_delta"]
    # the first verdict (the loop may trigger again before the history is read)
    verdict = next(r for r in new if r["event"] in ("promote", "rollback"))
    if verdict["reason"] == "guard_refused":          # the round's draft lost held-out ground
        assert [r["event"] for r in new[:3]] == ["trigger", "round", "rollback"]
        assert verdict["problems"]
    elif verdict["reason"] == "round_no_gain":        # no step beat the given draft
        assert [r["event"] for r in new[:3]] == ["trigger", "round", "rollback"]
        assert rnd["kept_step"] == 0
    else:
        assert [r["event"] for r in new[:3]] == ["trigger", "round", "canary"]
        assert verdict["reason"] in ("canary_won", "class_lost", "no_gain")
    assert set(results) == {200}
