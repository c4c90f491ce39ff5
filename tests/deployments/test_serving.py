"""The served app end to end on one local Ray cluster: every endpoint, tier, error and limit."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from serving_helpers import LONG_SERVING, MODEL, shared_app, sse_events

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ENDPOINTS = {"auto": "/v1", "premium": "/premium/v1", "standard": "/standard/v1",
             "economy": "/economy/v1"}
EXPECTED_TIER = {"premium": "speculative", "standard": "baseline", "economy": "small"}


@pytest.fixture(scope="module")
def app(long_family, module_tmp):
    return shared_app("long-serving", module_tmp, long_family, **LONG_SERVING)


def _completion(app, plan, **body):
    with app.client(plan) as client:
        return client.post(ENDPOINTS[plan] + "/completions",
                           json={"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 8,
                                 **body})


def test_health_and_models(app):
    health = httpx.get(app.url + "/health").json()
    assert health == {"status": "ok"}           # no key: ok / not ok only, no replica ids
    admin = {"Authorization": f"Bearer {app.admin_key}"}
    health = httpx.get(app.url + "/health", headers=admin).json()
    assert health["status"] == "ok" and set(health["tiers"]) == {"target", "small"}
    assert health["tiers"]["target"]["replica_ids"]
    user = {"Authorization": f"Bearer {app.keys['premium']}"}
    assert "tiers" not in httpx.get(app.url + "/health", headers=user).json()
    with app.client() as client:
        models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_status_lists_every_replica_with_its_node_and_load(app, monkeypatch):
    """`specserve status`'s replica table: Serve's replica actors, each tier replica with the
    load its own stats report."""
    import ray

    from cluster.launch.status import fetch_health, replica_rows, serve_replicas

    monkeypatch.setenv("SPECSERVE_ADMIN_KEY", app.admin_key)
    deadline = time.time() + 30
    while True:     # until Serve's stats broadcast (by replica id) has reached the ingress
        health, why = fetch_health(app.url)
        assert why is None
        rows = replica_rows(serve_replicas("specserve"), health)
        if all(r["state"] != "starting" for r in rows) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert {r["deployment"] for r in rows} == {"Ingress", "TargetServer", "SmallServer"}
    node = ray.util.get_node_ip_address()
    for r in rows:
        assert r["node"] == node and r["pid"] > 0 and r["state"] == "serving", r
        if r["deployment"] != "Ingress":
            assert r["running"] >= 0 and r["waiting"] >= 0 and 0 <= r["kv_headroom"] <= 1, r
    target = [r["replica"] for r in rows if r["deployment"] == "TargetServer"]
    assert target == health["tiers"]["target"]["replica_ids"]


@pytest.mark.parametrize("plan", ["auto", "premium", "standard", "economy"])
def test_completions_on_every_endpoint(app, plan):
    r = _completion(app, plan, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    usage = body["usage"]
    assert body["object"] == "text_completion" and body["choices"][0]["text"]
    assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] > 0
    assert usage["price_usd"] > 0 and usage["reason"]
    assert r.headers["x-specserve-tier"] == usage["tier"]
    assert r.headers["x-specserve-reason"] == usage["reason"]
    if plan in EXPECTED_TIER:
        assert usage["tier"] == EXPECTED_TIER[plan]

    with app.client(plan) as client, client.stream(
            "POST", ENDPOINTS[plan] + "/completions",
            json={"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 8, "stream": True,
                  "temperature": 0}) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = sse_events(stream)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == body["choices"][0]["text"]          # greedy: streamed == not streamed
    # auto decides each request from live stats, and the first one just taught the router the
    # tiny draft's acceptance: its second request may go elsewhere; a fixed plan may not
    if plan in EXPECTED_TIER:
        assert events[-2]["usage"]["tier"] == usage["tier"]
    assert events[-2]["usage"]["tier"] == stream.headers["x-specserve-tier"]


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_put_counts_on_every_chunk(app, chat):
    """vLLM's `stream_options.continuous_usage_stats` (sent by load clients such as guidellm,
    which every request of failed with a 400 before): running counts on every chunk, and the
    final chunk's usage is the priced one."""
    body = {"model": MODEL, "max_tokens": 8, "stream": True, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": "def add(a, b):"}]
    else:
        body["prompt"] = "def add(a, b):"
    path = ENDPOINTS["standard"] + ("/chat/completions" if chat else "/completions")
    with app.client("standard") as client, client.stream("POST", path, json=body) as stream:
        assert stream.status_code == 200, stream.read()
        events = sse_events(stream)[:-1]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 8
    assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + c
               for e, c in zip(events, counts))
    assert all(e["usage"]["prompt_tokens"] == events[-1]["usage"]["prompt_tokens"] > 0 for e in events)
    assert "price_usd" in events[-1]["usage"] and "price_usd" not in events[0]["usage"]


@pytest.mark.parametrize("plan", ["auto", "premium", "standard", "economy"])
def test_chat_with_the_openai_client(app, plan):
    import openai

    client = openai.OpenAI(base_url=app.url + ENDPOINTS[plan], api_key=app.keys[plan],
                           max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "print the squares"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                           temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens == 6
    extra = reply.usage.model_extra
    assert extra["tier"] and extra["price_usd"] > 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                 temperature=0, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def _target(app) -> dict:
    return app.handle("TargetServer").stats.remote().result(timeout_s=30)


def test_greedy_speculative_equals_baseline_token_for_token(app):
    prompts = ["def add(a, b):", "class Point:\n    def", "for i in range(10):"]
    drafts_before = _target(app)["metrics"]["num_draft_tokens"]
    for prompt in prompts:
        common = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                  "return_token_ids": True}
        spec = _completion(app, "premium", speculation="on", **common).json()
        base = _completion(app, "standard", speculation="off", **common).json()
        assert spec["usage"]["tier"] == "speculative" and base["usage"]["tier"] == "baseline"
        assert spec["choices"][0]["token_ids"] == base["choices"][0]["token_ids"]
        assert len(spec["choices"][0]["token_ids"]) == 24
        assert spec["usage"]["acceptance_rate"] is not None
    assert _target(app)["metrics"]["num_draft_tokens"] > drafts_before   # it did speculate


def _error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["message"]
    return error


def test_errors_have_status_and_openai_body(app):
    with app.client() as client:
        _error(client.post("/v1/completions", content=b"{not json",
                           headers={"content-type": "application/json"}), 400)
        err = _error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                          "temperature": 5}), 400)
        assert err["param"] == "temperature"
        _error(client.post("/v1/completions", json={"model": MODEL}), 400)     # no prompt
        _error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400)
        _error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                    "max_tokens": 0}), 400)
        err = _error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
        assert err["code"] == "model_not_found"
        assert _error(client.get("/v1/embeddingz"), 404)["code"] == "not_found"
        err = _error(client.post("/v1/completions",
                                 json={"model": MODEL, "prompt": "a " * 5000}), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        assert "at most 4095" in err["message"]     # 4096 positions: the prompt + one token
    no_key = httpx.post(app.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert _error(no_key, 401)["type"] == "authentication_error"
    bad_key = httpx.post(app.url + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                         headers={"Authorization": "Bearer sk-ss-nope"})
    _error(bad_key, 401)
    with app.client("economy") as client:
        err = _error(client.post("/premium/v1/completions",
                                 json={"model": MODEL, "prompt": "x"}), 403)
        assert err["type"] == "permission_error"
        _error(client.get("/premium/v1/models"), 403)
    with app.client("standard") as client:   # a standard key may use the cheaper endpoint
        assert client.post("/economy/v1/completions",
                           json={"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200


def test_overload_answers_429_with_retry_after(app):
    async def burst():
        async with app.async_client("economy") as client:
            # Long enough that the first request still runs when the last one arrives.
            body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 400,
                    "ignore_eos": True}
            return await asyncio.gather(*[client.post("/economy/v1/completions", json=body)
                                          for _ in range(10)])

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 429 in statuses, statuses
    assert set(statuses) <= {200, 429}
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"


def _target_stats(app) -> dict:
    return _target(app)["stats"]


def test_disconnected_stream_frees_its_kv(app):
    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 4000, "ignore_eos": True,
            "stream": True, "speculation": "on"}
    emitted_before = _target(app)["metrics"]["num_emitted_tokens"]
    with app.client("premium") as client, client.stream("POST", "/premium/v1/completions",
                                                         json=body) as stream:
        lines = stream.iter_lines()     # keep a reference: a closed iterator closes the socket
        for line in lines:
            if line.startswith("data: "):
                break
        stats = _target_stats(app)
        assert stats["num_running"] == 1 and stats["kv_used_target_bytes"] > 0
        assert stats["kv_used_draft_bytes"] > 0
        # The router sees it too: replica stats reach the ingress through Serve's routing stats.
        deadline = time.time() + 10
        admin = {"Authorization": f"Bearer {app.admin_key}"}
        while httpx.get(app.url + "/health", headers=admin).json()["tiers"]["target"]["running"] != 1:
            assert time.time() < deadline, "the ingress never saw the running sequence"
            time.sleep(0.2)
        lines.close()       # the client goes away mid-stream
    closed_at = time.time()
    while time.time() < closed_at + 10:
        stats = _target_stats(app)
        if stats["num_running"] == 0 and stats["kv_used_target_bytes"] == 0:
            break
        time.sleep(0.1)
    freed_after = time.time() - closed_at
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_used_target_bytes"] == 0 and stats["kv_used_draft_bytes"] == 0
    emitted = _target(app)["metrics"]["num_emitted_tokens"] - emitted_before
    assert emitted < 4000, "the sequence ran to the end: it was not aborted"
    assert freed_after < 5


def test_metrics_appear_on_the_export_port(app):
    _completion(app, "premium", speculation="on", temperature=0)
    wanted = ["ray_specserve_tier_decisions_total", "ray_specserve_requests_total",
              "ray_specserve_spec_decode_num_emitted_tokens_total",
              "ray_specserve_num_requests_running", "ray_specserve_kv_cache_used_bytes",
              "ray_specserve_time_to_first_token_seconds_bucket",
              "ray_specserve_inter_token_latency_seconds_bucket"]
    # the labels of this request's decision too: the names alone may be there already, from
    # the module's earlier requests, before this one's counts are exported
    wanted += ['tier="speculative"', 'reason="plan_premium"']
    deadline, missing = time.time() + 60, wanted
    while time.time() < deadline:
        text = httpx.get(app.metrics_url, timeout=10).text
        missing = [name for name in wanted if name not in text]
        if not missing:
            break
        time.sleep(2)
    assert not missing, f"not exported: {missing}"


PROCESSED_SCHEMA = {"type": "object",
                    "properties": {"name": {"type": "string", "maxLength": 6},
                                   "ok": {"type": "boolean"},
                                   "kind": {"enum": ["cat", "dog"]}},
                    "required": ["name", "ok", "kind"]}


@pytest.mark.parametrize("plan", ["premium", "standard", "economy"])
def test_penalties_bias_and_json_output_on_every_tier(app, plan):
    """Penalties, logit bias and response_format on chat and completions, each tier: the text
    matches the schema and the request ends with `stop`; a +100 bias decides greedy text."""
    import jsonschema

    processing = {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1,
                  "logit_bias": {"10": -100}, "temperature": 0.9, "seed": 3, "max_tokens": 80}
    formats = [{"type": "json_schema",
                "json_schema": {"name": "pet", "schema": PROCESSED_SCHEMA, "strict": True}},
               {"type": "json_object"}]
    with app.client(plan) as client:
        for chat, response_format in [(False, formats[0]), (True, formats[0]), (True, formats[1])]:
            body = {"model": MODEL, "response_format": response_format, **processing,
                    **({"messages": [{"role": "user", "content": "a pet"}]} if chat
                       else {"prompt": "a pet:"})}
            r = client.post(ENDPOINTS[plan] + ("/chat/completions" if chat else "/completions"),
                            json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert r.json()["usage"]["tier"] == EXPECTED_TIER[plan]
            text = choice["message"]["content"] if chat else choice["text"]
            if response_format["type"] == "json_schema":
                assert choice["finish_reason"] == "stop", text
                jsonschema.validate(json.loads(text), PROCESSED_SCHEMA)
            else:
                assert text.startswith("{")
                if choice["finish_reason"] == "stop":
                    assert isinstance(json.loads(text), dict)
        r = client.post(ENDPOINTS[plan] + "/completions",
                        json={"model": MODEL, "prompt": "x", "max_tokens": 4, "temperature": 0,
                              "logit_bias": {"42": 100}, "return_token_ids": True,
                              "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [42] * 4, r.text


def test_processing_errors_answer_400_naming_the_field(app):
    vocab_id = str(1 << 20)         # a valid id on the wire, beyond the tiny vocabulary
    cases = [({"presence_penalty": 2.5}, "presence_penalty"),
             ({"logit_bias": {"1": 250}}, "logit_bias.1"),
             ({"logit_bias": {vocab_id: 1}}, "logit_bias"),                 # the replica's 400
             ({"response_format": {"type": "xml"}}, "response_format.type"),
             ({"response_format": {"type": "json_schema", "json_schema": {
                 "name": "x", "schema": {"type": "nonsense"}}}}, "response_format")]   # compile
    for plan in ("premium", "economy"):
        with app.client(plan) as client:
            for extra, param in cases:
                r = client.post(ENDPOINTS[plan] + "/completions",
                                json={"model": MODEL, "prompt": "x", "max_tokens": 2, **extra})
                err = _error(r, 400)
                assert err["param"] == param, (plan, extra, err)
            assert client.post(ENDPOINTS[plan] + "/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_killed_target_engine_restarts_in_place_while_the_router_goes_around_it(app):
    """Last in the module (it kills the target's engine process, SIGKILL as the OOM killer
    would): the replica starts a new engine process in place (same replica process, no Serve
    replacement); meanwhile a caller who allows a downgrade is served by the small tier
    (`tier_down`), the others get a 503 with Retry-After, and the target serves again."""
    import os
    import signal

    target = app.handle("TargetServer")
    before = target.stats.remote().result(timeout_s=30)
    os.kill(before["engine_pid"], signal.SIGKILL)
    killed, reasons, refused = time.time(), set(), 0
    while True:
        r = _completion(app, "auto", allow_downgrade=True)
        if r.status_code == 200:
            reasons.add((r.headers["x-specserve-tier"], r.headers["x-specserve-reason"]))
        r = _completion(app, "premium")
        if r.status_code == 200:
            break
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
        refused += 1
        assert time.time() - killed < 60, "the target did not serve again within 60 s"
        time.sleep(0.2)
    print(f"target serving again {time.time() - killed:.1f} s after the kill; "
          f"{refused} premium requests refused meanwhile; seen {sorted(reasons)}")
    after = target.stats.remote().result(timeout_s=30)
    assert after["pid"] == before["pid"] and after["engine_pid"] != before["engine_pid"]
    assert after["restarts"] == 1
    assert ("small", "tier_down") in reasons and refused > 0
    # the group's next module (the fuzz) finds the app as this one found it: every tier
    # reporting, /health 200 (the router reads the new engine's stats a period later)
    while httpx.get(app.url + "/health", timeout=10).status_code != 200:
        assert time.time() - killed < 90, "/health not 200 within 90 s of the kill"
        time.sleep(0.2)
