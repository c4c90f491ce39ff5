"""`specserve bench chat` on the app the tiny fixed-k group shares (tests/app_groups.py), served
with prefix caching on, then deployed again with it off: the same greedy answers either way.
The group's last module: it leaves the app with caching off, so it stops it."""

import argparse
import asyncio

import pytest

from serving_helpers import close_shared, redeploy, shared_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def app(module_tmp, tiny_family):
    return shared_app("tiny-fixed-k", module_tmp, tiny_family,
                      target={"engine_args": {"adaptive_k": False}})


def test_bench_chat_answers_the_same_with_caching_on_and_off(app):
    """Conversations that resend their history through HTTP: with caching on the target's cache
    finds part of the prompts, with it off none, and every greedy answer is the same token for
    token, with the same log-probabilities."""
    from cluster.bench import chat

    parser = argparse.ArgumentParser()
    chat.add_arguments(parser)
    args = parser.parse_args(["--conversations", "2", "--turns", "3", "--system-words", "25",
                              "--user-words", "0", "--answer-tokens", "10",   # within 512 positions
                              # a random model's argmax hardly reads its context: compare the
                              # log-probabilities too (a wrong cached block moves them)
                              "--logprobs"])
    served = {"caching": True}    # as the group's app serves

    def deploy(caching: bool) -> None:
        if caching != served["caching"]:
            redeploy(app, target={"enable_prefix_caching": caching})
            served["caching"] = caching
    try:    # on (as served), then off: one deploy; the app is not the group's config after it
        report = asyncio.run(chat.bench(app.url, app.keys["auto"], args, deploy, app.admin_key,
                                        first="on"))
    finally:
        if not served["caching"]:
            close_shared()
    on, off = report["sides"]["on"], report["sides"]["off"]
    for side in (on, off):
        tokens = [t["prompt_tokens_mean"] for t in side["turns"]]
        assert len(tokens) == 3 and tokens[0] > 64 and tokens == sorted(tokens)   # histories grow
        assert side["output_tokens"] == 2 * 3 * 10 and side["output_tok_s"] > 0
        assert 0 < side["turns"][0]["ttft_p50_s"] <= side["turns"][0]["ttft_p90_s"]
    assert off["turns"] == [dict(t, ttft_p50_s=o["ttft_p50_s"], ttft_p90_s=o["ttft_p90_s"])
                            for t, o in zip(on["turns"], off["turns"])]   # the same prompts
    assert on["prefix_cache"]["hits"] > 0 and off["prefix_cache"]["hits"] == 0
    assert on["prefix_cache"]["queries"] == off["prefix_cache"]["queries"]
    assert [len(a) for turn in report["answers"][0] for a in turn] == [10] * 6
    assert report["answers_equal"]
    # equal up to float rounding (a batch's other rows differ on and off): 7e-7 when measured
    assert report["logprobs_max_diff"] < 1e-4
