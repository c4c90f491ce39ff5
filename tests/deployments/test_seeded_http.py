"""Seeded sampling over HTTP with the `openai` client, on a real local Ray cluster: the same
seed gives the same text on /premium (speculative), /standard (baseline) and /v1 (auto), sent
alone or under concurrent load; `system_fingerprint` says which replica numerics answered."""

from __future__ import annotations

import asyncio

import pytest

from serving_helpers import MODEL, shared_app

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
    return shared_app("tiny-fixed-k", module_tmp, tiny_family,
                      target={"engine_args": {"adaptive_k": False}})


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


# -- log-probabilities (docs/decisions/0025-logprobs.md) ------------------------------------
LOGPROB_TIERS = {"premium": "speculative", "standard": "baseline", "economy": "small"}


def _chat_logprobs(app, plan, stream=False):
    """(entries, token ids or None, text). A long stop string holds the text back, so most
    stream chunks carry tokens (and their logprobs) without text."""
    client = _client(app, plan)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}],
              max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=3,
              stop=["#" * 200], extra_body={"ignore_eos": True, "return_token_ids": not stream})
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].logprobs.content, r.choices[0].token_ids, r.choices[0].message.content
    entries, text = [], ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            choice = chunk.choices[0]
            entries += choice.logprobs.content if choice.logprobs else []
            text += choice.delta.content or ""
    return entries, None, text


def test_chat_logprobs_on_every_tier_streamed_and_not(app):
    """Greedy chat: one entry per output token with 3 alternatives best first, the chosen one
    the best; the stream carries the same entries as the body; speculative and baseline report
    the same values (one target); the small tier its own model's."""
    got = {}
    for plan in LOGPROB_TIERS:
        body, ids, text = _chat_logprobs(app, plan)
        streamed, _, streamed_text = _chat_logprobs(app, plan, stream=True)
        assert len(body) == len(ids) == len(streamed) == MAX_TOKENS and streamed_text == text
        for e, s in zip(body, streamed):
            assert (e.token, e.bytes) == (s.token, s.bytes)
            assert e.logprob == pytest.approx(s.logprob, abs=1e-5)
            assert e.bytes == list(e.token.encode("utf-8")) and e.logprob <= 0
            assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
            values = [t.logprob for t in e.top_logprobs]
            assert values == sorted(values, reverse=True) and values[0] == e.logprob
        got[plan] = [e.logprob for e in body]
    assert got["premium"] == pytest.approx(got["standard"], abs=1e-4)
    assert got["economy"] != pytest.approx(got["standard"], abs=1e-4)


def _reference_logprobs(path, ids):
    """log_softmax of one transformers forward: row i scores ids[i + 1]."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_echo_scores_multiple_choice_like_an_eval_harness(app, tiny_family):
    """lm-eval-harness's loglikelihood: send context + continuation with echo, logprobs 1 and
    max_tokens 1; the continuation's summed token logprobs equal an independent forward's,
    on the speculative and the baseline tier, and rank the choices alike."""
    context = [5, 9, 13, 17, 21, 25, 29]
    choices = [[33, 37], [40, 2, 7], [11]]
    for plan in ("premium", "standard"):
        client = _client(app, plan)
        sums, want = [], []
        for cont in choices:
            ids = context + cont
            r = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1,
                                          max_tokens=1, temperature=0)
            lp = r.choices[0].logprobs
            assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
            assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
            assert r.choices[0].text.startswith("".join(lp.tokens[:len(ids)]))
            assert lp.text_offset == sorted(lp.text_offset)
            assert all(len(top) in (1, 2) and tok in top
                       for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
            sums.append(sum(lp.token_logprobs[len(context):len(ids)]))
            ref = _reference_logprobs(tiny_family["target"], ids)
            assert lp.token_logprobs[1:len(ids)] == pytest.approx(ref.tolist(), abs=1e-3)
            want.append(float(ref[len(context) - 1:].sum()))
        assert sums == pytest.approx(want, abs=2e-3)
        assert max(range(3), key=sums.__getitem__) == max(range(3), key=want.__getitem__)


def test_completion_stream_echoes_the_prompt_first(app):
    import httpx

    from serving_helpers import sse_events

    body = {"model": MODEL, "prompt": "def add(a, b):", "echo": True, "logprobs": 2,
            "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=120) as http:
        r = http.post(app.url + "/premium/v1/completions", json=body,
                      headers={"authorization": f"Bearer {app.keys['premium']}"})
    assert r.status_code == 200, r.text
    chunks = [e for e in sse_events(r) if e != "[DONE]"]
    assert chunks[0]["choices"][0]["text"].startswith("def add(a, b):")
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    tokens = [t for lp in lps for t in lp["tokens"]]
    values = [v for lp in lps for v in lp["token_logprobs"]]
    offsets = [o for lp in lps for o in lp["text_offset"]]
    assert values[0] is None and all(v <= 0 for v in values[1:])
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert len(tokens) == chunks[-1]["usage"]["prompt_tokens"] + 4


def test_n_choices_with_the_openai_client(app, tiny_family):
    """n = 3 on the speculative and the baseline endpoint: three choices, choice i the text a
    single request with seed + i gives, usage summing every choice (the prompt once) and priced
    so; streamed, each chunk names its choice, each choice finishes once and the usage comes on
    the last chunk, equal to the body's."""
    from router.billing import RunCounts, price_micro_usd
    from router.config import AppConfig
    from serving_helpers import app_config

    prices = AppConfig.model_validate(app_config(tiny_family, [])).prices
    for plan in ("premium", "standard"):
        client = _client(app, plan)
        req = {**_request(3), "extra_body": {"ignore_eos": True}}
        r = client.completions.create(n=3, **req)
        assert [c.index for c in r.choices] == [0, 1, 2]
        singles = [client.completions.create(**{**req, "seed": SEEDS[3] + i}) for i in range(3)]
        assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
        assert len({c.text for c in r.choices}) > 1        # sampled: the choices differ
        assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
        assert r.usage.completion_tokens == 3 * MAX_TOKENS
        tier = r.usage.tier
        spec = 3 * MAX_TOKENS if tier == "speculative" else 0
        run = RunCounts(tier, r.usage.prompt_tokens, 3 * MAX_TOKENS, spec)
        assert round(r.usage.price_usd * 1e6) == price_micro_usd(prices, run)

        stream = client.completions.create(n=3, stream=True, **req)
        texts, finished, usage = {}, [], None
        for chunk in stream:
            assert usage is None                  # nothing after the usage
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                if c.finish_reason:
                    finished.append(c.index)
            usage = chunk.usage
        assert sorted(finished) == [0, 1, 2] and texts == {c.index: c.text for c in r.choices}
        assert usage.completion_tokens == 3 * MAX_TOKENS
        assert usage.price_usd == r.usage.price_usd


def test_n_choices_in_chat_stream_say_their_role_once_each(app):
    client = _client(app, "premium")
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}], n=2,
        max_tokens=5, temperature=0, stream=True)
    roles, texts = [], {}
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.index)
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert sorted(roles) == [0, 1] and texts[0] == texts[1]     # greedy: the same text
