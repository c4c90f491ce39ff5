"""A bounded, seeded fuzz of the HTTP API on the real local cluster.

Categories: malformed JSON, wrong types, out-of-range values, unsupported OpenAI fields, huge
bodies, deep nesting, unicode edge cases (lone surrogates, NUL, RTL, emoji, overlong and invalid
UTF-8), every endpoint (/v1 and the three pricing prefixes; completions, chat, models, health)
with every plan's key, no key and a bad key, and wrong methods. Every answer must be a valid
200 or a 4xx in OpenAI's error shape (never a 5xx), and the cluster must serve normally after.
The same cluster then runs `specserve bench overload` for a few seconds.
"""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from serving_helpers import LONG_SERVING, MODEL, shared_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PREFIXES = ("/v1", "/premium/v1", "/standard/v1", "/economy/v1")
SEED, NUM_CASES = 9, 600
WRONG = [True, False, "yes", "16", 5.5, -1, 0, None, [], {}, [1, "a"], {"a": 1}, 2 ** 64,
         -2 ** 70, 1e308, "x" * 300, "\u0000"]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "stop", "seed", "stream", "n", "echo", "logit_bias",
          "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "best_of", "suffix",
          "speculation", "allow_downgrade", "return_token_ids", "ignore_eos", "user",
          "stream_options", "tools", "response_format", "unknown_field"]
OUT_OF_RANGE = {"temperature": [2.5, -0.5, 1e9], "top_p": [0, 1.01, -1], "top_k": [-1, 2 ** 63,
                9223372036854775808, 2 ** 21], "max_tokens": [0, -5, 2 ** 40, 10 ** 6],
                "max_completion_tokens": [0, 2 ** 40], "n": [0, 17, 129], "seed": [-2 ** 63 - 1, 2 ** 64],
                "presence_penalty": [5, -3, 2.01], "frequency_penalty": [2.5, -2.01],
                "stop": [["a"] * 5, ["x" * 1000], ["\n"] * 10_000, [""]], "best_of": [4],
                "logprobs": [6, -1], "top_logprobs": [21, -1], "echo": ["yes", 1],
                "logit_bias": [{"1": 101}, {"x": 1}]}
TEXTS = ["\u0000", "a\u0000b", "\u202e\u05e9\u05dc\u05d5\u05dd \u0627\u0644\u0633\u0644\u0627\u0645",
         "\U0001F600\U0001F469\u200d\U0001F4BB", "\ufeff\ufffd", "e\u0301\u0301\u0301", " ",
         "\t\n\r", "def add(a, b):", "x" * 3000]
LONE = ['"\\ud800"', '"a\\udfff"', '"\\ud83d x"', '"\\udc00\\ud800"']
RAW_UTF8 = [b"\xc0\xaf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xff", b"\xf8\x88\x80\x80\x80",
            b"\xc3", b"\xef\xbb\xbf"]


@pytest.fixture(scope="module")
def app(long_family, module_tmp):
    return shared_app("long-serving", module_tmp, long_family, **LONG_SERVING)


def _base(rng: random.Random, chat: bool) -> dict:
    body = {"model": MODEL, "max_tokens": rng.choice([1, 2, 3]), "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(TEXTS[:9])}]
    else:
        body["prompt"] = rng.choice([rng.choice(TEXTS), [1, 2, 3]])
    if rng.random() < 0.3:
        body["stream"] = True
    return body


def _case(rng: random.Random, keys: dict) -> tuple:
    """(method, path, headers, body bytes or None, expected statuses or None)."""
    prefix = rng.choice(PREFIXES)
    route = rng.choices(["completions", "chat/completions", "models", "health", "unknown"],
                        [10, 10, 2, 1, 1])[0]
    path = "/health" if route == "health" else f"{prefix}/{route}"
    if route == "unknown":
        path = rng.choice(["/v1/embeddings", "/v2/completions", "/premium/v1/chat", "/",
                           "/v1/completions/x", "/%ff%fe", "/v1/\u202emodels"])
    who = rng.choices(["plan", "none", "bad", "malformed"], [12, 1, 1, 1])[0]
    headers = {"content-type": "application/json"}
    if who == "plan":
        headers["authorization"] = f"Bearer {keys[rng.choice(list(keys))]}"
    elif who == "bad":
        headers["authorization"] = "Bearer sk-ss-" + "".join(rng.choices("abcdef0123", k=40))
    elif who == "malformed":
        headers["authorization"] = rng.choice(["Bearer", "Basic Zm9vOmJhcg==", "bearer sk-ss-", "x" * 500])
    method = "GET" if route in ("models", "health", "unknown") else "POST"
    if rng.random() < 0.05:
        method = rng.choice(["GET", "PUT", "DELETE", "PATCH"])
    if method != "POST":
        return method, path, headers, None, None
    chat = route == "chat/completions"
    body = _base(rng, chat)
    kind = rng.choice(["valid", "valid", "malformed", "wrong_type", "out_of_range", "huge", "deep",
                       "unicode", "unicode", "raw_bytes", "drop_field", "unknown_model"])
    expect = None
    if kind == "wrong_type":
        body[rng.choice(FIELDS)] = rng.choice(WRONG)
    elif kind == "unknown_model":
        body["model"] = rng.choice(["gpt-9", "TINY", "tiny ", "\u202etiny", "\U0001F600", "m" * 256])
        expect = {401, 403, 404}
    elif kind == "out_of_range":
        field = rng.choice(list(OUT_OF_RANGE))
        body[field] = rng.choice(OUT_OF_RANGE[field])
        expect = {400, 401, 403}
    elif kind == "drop_field":
        body.pop(rng.choice(["model", "messages" if chat else "prompt"]))
        expect = {400, 401, 403}
    elif kind == "unicode":                     # a lone surrogate somewhere: always a 400
        target, lone = rng.choice(["model", "content", "stop", "name", "key"]), rng.choice(LONE)
        if target == "model":
            body["model"] = "@LONE@"
        elif target == "content" and chat:
            body["messages"][0]["content"] = [{"type": "text", "text": "@LONE@"}]
        elif target == "content":
            body["prompt"] = "@LONE@"
        elif target == "stop":
            body["stop"] = ["@LONE@"]
        elif target == "name" and chat:
            body["messages"][0]["name"] = "@LONE@"
        else:
            body["@LONE@"] = 1
        text = json.dumps(body).replace('"@LONE@"', lone)
        return method, path, headers, text.encode(), {400, 401, 403}
    raw = json.dumps(body).encode()
    if kind == "malformed":
        raw = rng.choice([raw[: rng.randrange(1, len(raw))], raw + b"}", b"", b"null", b"[]",
                          b"42", b'"str"', b"{'model': 'tiny'}", raw.replace(b":", b"=", 1),
                          bytes(rng.randrange(256) for _ in range(64)), b"{" * 50])
        expect = {400, 401, 403}
    elif kind == "huge":
        size = rng.choice([(1 << 20) + 10, 3 << 20])
        raw = raw[:-1] + b', "user": "' + b"a" * size + b'"}'
        expect = {401, 403, 413}
    elif kind == "deep":
        depth = rng.choice([17, 100, 1000, 20_000])
        raw = raw[:-1] + b', "metadata": ' + b"[" * depth + b"]" * depth + b"}"
        expect = {400, 401, 403}
    elif kind == "raw_bytes":
        bad = rng.choice(RAW_UTF8)
        raw = raw.replace(b'"temperature"', b'"user": "a' + bad + b'", "temperature"', 1)
        expect = None if bad == b"\xef\xbb\xbf" else {400, 401, 403}
    return method, path, headers, raw, expect


def _check(response: httpx.Response, case: tuple) -> None:
    method, path, _, raw, expect = case
    where = f"{method} {path} {raw[:200] if raw else None!r}"
    assert response.status_code < 500, f"{response.status_code} for {where}: {response.text[:500]}"
    if expect is not None:
        assert response.status_code in expect, f"{response.status_code} for {where}"
    if response.status_code != 200:
        assert response.status_code >= 400, where
        error = response.json()["error"]
        assert set(error) == {"message", "type", "code", "param"}, where
        assert isinstance(error["message"], str) and error["message"] and error["type"], where
        assert "Traceback" not in error["message"] and len(error["message"]) < 1000, where
        if response.status_code in (429, 503):
            assert int(response.headers["retry-after"]) >= 1
        return
    if "text/event-stream" in response.headers.get("content-type", ""):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", where
        assert all("error" not in json.loads(e) for e in events[:-1]), where
    elif path.endswith("completions"):
        assert response.json()["choices"], where
    elif path.endswith("models"):
        assert response.json()["data"][0]["id"] == MODEL


def test_fuzz_gives_only_4xx_in_openai_shape_or_valid_200s(app):
    rng = random.Random(SEED)
    cases = [_case(rng, app.keys) for _ in range(NUM_CASES)]
    statuses: dict[int, int] = {}
    start = time.time()
    with httpx.Client(base_url=app.url, timeout=60) as client:
        for case in cases:
            method, path, headers, raw, _ = case
            response = client.request(method, path, headers=headers, content=raw)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            _check(response, case)
    elapsed = time.time() - start
    print(f"fuzz: {NUM_CASES} cases in {elapsed:.1f}s, statuses {sorted(statuses.items())}")
    assert statuses.get(200, 0) >= 20 and statuses.get(400, 0) >= 50, statuses
    assert {401, 403, 404, 405, 413} <= set(statuses), statuses
    # The cluster still serves, and nothing is left running.
    with app.client() as client:
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "def add(a, b):",
                                                   "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    stats = app.handle("TargetServer").stats.remote().result(timeout_s=30)["stats"]
    assert stats["num_running"] == 0 and stats["kv_used_target_bytes"] == 0


def test_named_defects_each_answer_400(app):
    """Requests an edge that is not strict answers 500, 503 or 200: each is a 400 with a code."""
    def post(path, raw, headers=None):
        with app.client() as client:
            return client.post(path, content=raw, headers={"content-type": "application/json",
                                                            **(headers or {})})

    base = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    cases = [
        ({**base, "top_k": 9223372036854775808}, "top_k"),
        ({**base, "max_tokens": True}, "max_tokens"),
        ({**base, "stream": "yes"}, "stream"),
        ({**base, "stop": ["s"] * 10_000}, "stop"),
        ({**base, "presence_penalty": 5}, "presence_penalty"),
        ({**base, "logit_bias": {"1": 500}}, "logit_bias"),
        ({**base, "echo": "yes"}, "echo"),
        ({**base, "logprobs": 6}, "logprobs"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
          "top_logprobs": 21}, "top_logprobs"),
        ({**base, "prompt": [5.5]}, "prompt"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
          "max_completion_tokens": 2 ** 40}, "max_completion_tokens"),
    ]
    for body, param in cases:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = post(path, json.dumps(body).encode())
        assert r.status_code == 400, (param, r.text)
        assert r.json()["error"]["param"].startswith(param) and r.json()["error"]["code"]
    deep = b'{"model": "tiny", "prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    assert post("/v1/completions", deep).json()["error"]["code"] == "json_too_deep"
    for raw, path in [(b'{"model": "\\ud800", "prompt": "x"}', "/v1/completions"),
                      (b'{"model": "tiny", "prompt": "\\ud800"}', "/v1/completions"),
                      (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
                       "/v1/chat/completions")]:
        r = post(path, raw)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", r.text
        assert "retry-after" not in r.headers
    # The target replica still serves after all of them.
    r = post("/v1/completions", json.dumps(base).encode())
    assert r.status_code == 200, r.text


def test_bench_overload_loses_nothing(app):
    """`specserve bench overload` for a few seconds: every request ends, KV back to 0."""
    import argparse

    from cluster.bench import overload as bench_overload

    args = argparse.Namespace(capacity_s=2.0, concurrency=4, factor=4.0, duration=4.0,
                              max_tokens=8, deadline_s=60.0, seed=0, settle_s=15.0)
    report = bench_overload.run_bench(app.url, app.keys["auto"], MODEL, args, "specserve")
    bench_overload.print_report(report)
    assert report["capacity_rps"] > 0 and report["requests"] >= 10
    assert report["never_ended"] == 0 and report["bad_5xx"] == 0, report
    assert report["bad_requests_not_refused"] == 0 and report["429_without_retry_after"] == 0
    assert report["p95_admitted_s"] is not None
    assert set(report["kv_in_use_after"]) == {"TargetServer", "SmallServer"}
    assert not any(report["kv_in_use_after"].values()), report
    assert not any(report["running_after"].values()) and not any(report["replica_restarts"].values())


def test_a_stream_cut_by_a_replica_failure_ends_with_an_error_event(app):
    """Kill the small replica's process mid-stream: the client gets an error event in OpenAI's
    shape (with a code, no exception text), then `[DONE]`. Runs last: Serve replaces it."""
    import os
    import signal

    body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 3000, "ignore_eos": True,
            "stream": True}
    # asked before the stream: the small tier takes one request at a time (LONG_SERVING)
    pid = app.handle("SmallServer").stats.remote().result(timeout_s=30)["pid"]
    with app.client("economy") as client, client.stream("POST", "/economy/v1/completions",
                                                        json=body) as stream:
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        os.kill(pid, signal.SIGKILL)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert set(error) == {"message", "type", "code", "param"} and error["code"] == "replica_failed"
    assert "Error" not in error["message"] and "Traceback" not in error["message"], error
