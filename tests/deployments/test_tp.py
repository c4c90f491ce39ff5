"""A tensor-parallel target replica (TP = 2 on CPU, gloo) on a local Ray cluster.

One Serve replica owns a placement group of two bundles; rank 1 is a child actor in bundle 1.
Checks that TP = 2 gives TP = 1's greedy tokens (with a draft whose KV shape differs from the
target's), that a forward failing on rank 1 gives its request an OpenAI-shaped error and brings
the group down and back, and that killing rank 1 does too (the replica exits at once, Serve
builds a new group).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from serving_helpers import MODEL, served_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = ["def add(a, b):", "class Point:\n    def"]


@pytest.fixture(scope="module")
def app(tiny_family, odd_draft, module_tmp):
    # The draft's KV shape differs from the target's (the production 70B/7B case): rank 0's pool
    # uses more tokens per block than block_size, and rank 1 must take that layout from it.
    family = {**tiny_family, "draft": odd_draft}
    with served_app(module_tmp, family, small=None,
                    target={"tp_size": 2, "num_cpus_per_rank": 0.5,
                            "engine_args": {"adaptive_k": False,        # always draft
                                            "fault_injection": True}}) as served:
        yield served


def _tp1_tokens(family, prompt: str, max_tokens: int) -> list[int]:
    """Greedy tokens of the unsharded target, from the engine in this process (no Ray)."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.sampling_params import Mode, RequestOptions, SamplingParams

    engine = AsyncEngine(EngineConfig(target=str(family["target"]), num_threads=1,
                                      kv_budget_bytes=8 << 20))
    try:
        ids = engine.tokenizer(prompt)["input_ids"]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

        async def run():
            out = []
            async for o in engine.generate("tp1", ids, params, RequestOptions(mode=Mode.BASELINE)):
                out += o.token_ids
            return out

        return asyncio.run(run())
    finally:
        engine.shutdown()


def _tokens(app, plan: str, prompt: str, max_tokens: int, **extra) -> list[int]:
    with app.client(plan) as client:
        r = client.post(f"/{plan}/v1/completions",
                        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                              "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                              **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_tp2_gives_the_greedy_tokens_of_tp1(app, tiny_family):
    for prompt in PROMPTS:
        expected = _tp1_tokens(tiny_family, prompt, 16)
        assert _tokens(app, "standard", prompt, 16, speculation="off") == expected
        assert _tokens(app, "premium", prompt, 16, speculation="on") == expected


def _wait_for_new_replica(app, target, old_replica_pid: int, since: float) -> float:
    """Seconds from `since` until a new replica (new pid) answers and /health is ok."""
    deadline = since + 120
    new_pid = None
    while time.time() < deadline:
        try:
            new_pid = target.stats.remote().result(timeout_s=10)["pid"]
            if new_pid != old_replica_pid:
                break
        except Exception:      # the old replica is gone and the new one is not up yet
            pass
        time.sleep(0.5)
    assert new_pid is not None and new_pid != old_replica_pid, "the replica was not replaced"
    while time.time() < deadline and httpx.get(app.url + "/health").status_code != 200:
        time.sleep(0.5)
    return time.time() - since


def test_a_forward_failing_on_rank_1_errors_its_request_and_the_group_is_rebuilt(app, tiny_family):
    """Rank 1 raises mid-forward (between two layers' all-reduces): the request in that
    forward gets an OpenAI-shaped 5xx, the replica leaves (its ranks' collectives would be out
    of step) and Serve builds a new group, whose greedy tokens are TP = 1's again."""
    target = app.handle("TargetServer")
    old_replica_pid = target.stats.remote().result(timeout_s=30)["pid"]
    target.inject_fault.remote("rank_raise", 1, 1).result(timeout_s=30)
    failed_at = time.time()
    with app.client("standard") as client:
        r = client.post("/standard/v1/completions",
                        json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8,
                              "temperature": 0, "ignore_eos": True, "speculation": "off"})
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "replica_failed" and error["message"], error
    print(f"group rebuilt in {_wait_for_new_replica(app, target, old_replica_pid, failed_at):.1f}s")
    expected = _tp1_tokens(tiny_family, PROMPTS[1], 12)
    assert _tokens(app, "standard", PROMPTS[1], 12, speculation="off") == expected


def test_a_killed_rank_is_replaced_and_requests_succeed_again(app):
    target = app.handle("TargetServer")
    old_replica_pid = target.stats.remote().result(timeout_s=30)["pid"]
    (rank_pid,) = target.tp_rank_pids.remote().result(timeout_s=30)
    os.kill(rank_pid, signal.SIGKILL)
    killed_at = time.time()
    print(f"group rebuilt in {_wait_for_new_replica(app, target, old_replica_pid, killed_at):.1f}s")
    new_ranks = target.tp_rank_pids.remote().result(timeout_s=30)
    assert rank_pid not in new_ranks and len(new_ranks) == 1
    assert _tokens(app, "standard", PROMPTS[0], 8, speculation="off")
