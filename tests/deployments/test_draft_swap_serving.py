"""`specserve draft swap` on a real local Ray cluster: requests keep succeeding while the target
replica swaps its draft in place, and afterwards it drafts with the new one (a copy of the
target, so every drafted token is accepted); rollback returns to the old draft."""

from __future__ import annotations

import json
import threading

import pytest

from serving_helpers import MODEL, shared_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def perfect_draft(tiny_family, tmp_path_factory):
    """A 'distilled' draft equal to the target (same shape as the tiny draft), with its report."""
    import shutil

    folder = tmp_path_factory.mktemp("perfect") / "draft"
    shutil.copytree(tiny_family["target"], folder)
    held = {"chat": {"acceptance": 0.5}, "code": {"acceptance": 0.6}}
    (folder / "distill.json").write_text(json.dumps({"heldout": {
        "before": held, "after": {c: {"acceptance": 1.0} for c in held}}}))
    return folder


def _spec(client, n=12):
    r = client.post("/premium/v1/completions", json={"model": MODEL, "prompt": "def add(a, b):",
                                                     "max_tokens": n, "temperature": 0})
    return r.status_code, (r.json().get("usage") if r.status_code == 200 else r.text)


def test_swap_during_traffic_drops_nothing_and_serves_the_new_draft(
        tiny_family, perfect_draft, module_tmp):
    from cluster.cli.draft_swap import apply

    app = shared_app("tiny-fixed-k", module_tmp, tiny_family,
                     target={"engine_args": {"adaptive_k": False}})
    with app.client("premium") as client:
        status, usage = _spec(client)
        assert status == 200, usage
        before_rate = usage["acceptance_rate"]
    results, stop = [], threading.Event()

    def traffic():
        with app.client("premium") as c:
            while not stop.is_set():
                results.append(_spec(c, 24))

    threads = [threading.Thread(target=traffic) for _ in range(3)]
    for t in threads:
        t.start()
    while len(results) < 3:
        threading.Event().wait(0.2)
    swapped = apply("specserve", str(perfect_draft), rollback=False)
    n_at_swap = len(results)
    while len(results) < n_at_swap + 6:
        threading.Event().wait(0.2)
    stop.set()
    for t in threads:
        t.join()
    assert swapped[0]["draft"] == str(perfect_draft.resolve())
    assert swapped[0]["previous"] == str(tiny_family["draft"].resolve())
    assert [s for s, _ in results if s != 200] == []             # nothing dropped
    with app.client("premium") as client:
        status, usage = _spec(client)
    assert status == 200 and usage["acceptance_rate"] == 1.0 and before_rate < 1.0
    back = apply("specserve", None, rollback=True)
    assert back[0]["draft"] == str(tiny_family["draft"].resolve())
    with app.client("premium") as client:
        status, usage = _spec(client)
    assert status == 200 and usage["acceptance_rate"] == before_rate
