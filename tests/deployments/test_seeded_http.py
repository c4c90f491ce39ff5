"""Seeded sampling over HTTP with the `openai` client, on a real local Ray cluster: the same
seed gives the same text on /premium (speculative), /standard (baseline) and /v1 (auto), sent
alone or under concurrent load; `system_fingerprint` says which replica numerics answered."""

from __future__ import annotations

import asyncio

import pytest

from serving_helpers import MODEL, served_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ENDPOINTS = {"premium": "/premium/v1", "standard": "/standard/v1", "auto": "/v1"}
PROMPTS = ["def add(a, b):", "class Point:", "for i in range(10):", "import os\n"]
SEEDS = [100 + i for i in range(20)]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def app(tiny_family, module_tmp):
    # The tiny draft costs as much as the tiny target, so adaptive k would never draft here:
    # premium drafts k_max tokens every step instead (tests/engine/test_seeded.py covers
    # adaptive k). Baseline and speculative sequences share the target's batches.
    with served_app(module_tmp, tiny_family, target={"engine_args": {"adaptive_k": False}}) as served:
        yield served


def _client(app, plan, asynchronous=False):
    import openai

    cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return cls(base_url=app.url + ENDPOINTS.get(plan, f"/{plan}/v1"), api_key=app.keys[plan],
               max_retries=5, timeout=120)


def _request(i: int) -> dict:
    return {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS,
            "temperature": 0.8, "seed": SEEDS[i]}


def test_seeded_text_is_the_same_on_every_endpoint_alone_and_under_load(app):
    alone, fingerprints = {}, set()
    for plan in ENDPOINTS:
        client = _client(app, plan)
        alone[plan] = []
        for i in range(len(SEEDS)):
            r = client.completions.create(**_request(i))
            alone[plan].append(r.choices[0].text)
            fingerprints.add(r.system_fingerprint)
            if plan == "premium":
                assert r.usage.tier == "speculative" and r.usage.acceptance_rate is not None
    assert len(set(alone["standard"])) > len(PROMPTS)          # seeds matter, text is sampled
    assert alone["premium"] == alone["standard"] == alone["auto"]
    assert len(fingerprints) == 1 and next(iter(fingerprints)).startswith("fp_")

    async def load():
        clients = {plan: _client(app, plan, asynchronous=True) for plan in ENDPOINTS}
        seeded = [clients[plan].completions.create(**_request(i))
                  for i in range(len(SEEDS)) for plan in ENDPOINTS]
        noise = [clients["premium"].completions.create(model=MODEL, prompt=p, max_tokens=24,
                                                       temperature=1.0) for p in PROMPTS]
        out = await asyncio.gather(*seeded, *noise)
        return out[:len(seeded)]

    loaded = asyncio.run(load())
    for n, r in enumerate(loaded):
        i, plan = divmod(n, len(ENDPOINTS))
        assert r.choices[0].text == alone["standard"][i], (plan, SEEDS[i])


def test_system_fingerprint_in_chat_and_streams(app):
    client = _client(app, "premium")
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0.8, "seed": 7}
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **body)
    stream = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}],
                                            stream=True, **body)
    chunks = list(stream)
    assert {c.system_fingerprint for c in chunks} == {chat.system_fingerprint}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        chat.choices[0].message.content
    completions = list(client.completions.create(prompt="x = ", stream=True, **body))
    assert {c.system_fingerprint for c in completions} == {chat.system_fingerprint}
    # The economy tier runs another model: another fingerprint.
    economy = _client(app, "economy").completions.create(prompt="x = ", **body)
    assert economy.system_fingerprint.startswith("fp_")
    assert economy.system_fingerprint != chat.system_fingerprint
