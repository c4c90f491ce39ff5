"""The edge's request validation without Ray: bytes -> JSON -> strict model, every bound a 400.

Each case here is one an edge that is not strict and bounded accepts (or crashes on).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from router.admission import Admission
from router.config import AppConfig
from router.openai_schema import ChatCompletionRequest, CompletionRequest, HTTPError
from router.validation import json_depth, parse_json_object, read_body, validate_request

OK = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def refused(model_cls, body: dict, status: int = 400) -> HTTPError:
    with pytest.raises(HTTPError) as info:
        validate_request(model_cls, parse_json_object(json.dumps(body).encode(), 16))
    err = info.value
    assert err.status == status and err.message and err.code
    json.dumps(err.response().body.decode())       # renders
    return err


@pytest.mark.parametrize("field,value", [
    ("stream", "yes"), ("stream", 1), ("max_tokens", True), ("max_tokens", "16"),
    ("max_tokens", 5.5), ("temperature", "0.5"), ("temperature", True), ("top_k", 2.5),
    ("top_k", True), ("seed", "1"), ("ignore_eos", "false"), ("return_token_ids", 0),
    ("allow_downgrade", "true"), ("model", 7), ("stop", 3), ("stop", [1]),
    ("stream_options", {"include_usage": "yes"}), ("user", 5),
])
def test_no_coercion(field, value):
    err = refused(CompletionRequest, {**OK, field: value})
    assert err.param.startswith(field) and err.code == "invalid_value"


@pytest.mark.parametrize("field,value", [
    ("temperature", 2.01), ("temperature", -0.1), ("top_p", 0), ("top_p", 1.5),
    ("top_k", 9223372036854775808), ("top_k", -1), ("top_k", (1 << 20) + 1),
    ("max_tokens", 0), ("max_tokens", 2 ** 40), ("seed", -2 ** 63 - 1), ("seed", 2 ** 63), ("n", 0), ("n", 129),
    ("stop", ["a", "b", "c", "d", "e"]), ("stop", ["x" * 257]), ("stop", "x" * 257),
    ("stop", [""]), ("stop", ["\n"] * 10_000), ("model", ""), ("model", "m" * 300),
])
def test_ranges_and_counts(field, value):
    assert refused(CompletionRequest, {**OK, field: value}).param.startswith(field)


def test_token_ids_are_ints_in_range():
    assert validate_request(CompletionRequest, {**OK, "prompt": [1, 2]}).prompt == [1, 2]
    assert validate_request(CompletionRequest, {**OK, "prompt": [[3]]}).prompt == [3]
    for prompt in ([5.5], [1, True], [-1], [2 ** 40], [], [[]], [[1], [2]], ["a", "b"],
                   [1] * ((1 << 17) + 1)):
        assert refused(CompletionRequest, {**OK, "prompt": prompt}).param.startswith("prompt")


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function"}]), ("tool_choice", "auto"), ("top_logprobs", 2),
    ("best_of", 3), ("suffix", "end"),
])
def test_unsupported_fields_are_refused_by_name(field, value):
    err = refused(CompletionRequest, {**OK, field: value})
    assert err.code == "unsupported_parameter" and err.param == field and field in err.message


def test_n_is_an_integer_in_range():
    assert validate_request(CompletionRequest, {**OK, "n": 3}).n == 3
    assert validate_request(ChatCompletionRequest, {**CHAT, "n": 128}).n == 128
    for value in (0, 129, True, 2.5, "2"):
        assert refused(CompletionRequest, {**OK, "n": value}).param == "n"


def test_chat_refuses_echo_by_name():
    err = refused(ChatCompletionRequest, {**CHAT, "echo": True})
    assert err.code == "unsupported_parameter" and err.param == "echo"
    assert validate_request(ChatCompletionRequest, {**CHAT, "echo": False}).model == "m"


@pytest.mark.parametrize("api,field,value", [
    ("chat", "top_logprobs", 21), ("chat", "top_logprobs", -1), ("chat", "top_logprobs", 1.5),
    ("chat", "logprobs", 1), ("chat", "logprobs", "true"), ("chat", "top_logprobs", 3),
    ("completions", "logprobs", 6), ("completions", "logprobs", -1),
    ("completions", "logprobs", True), ("completions", "logprobs", 2.0),
    ("completions", "echo", 1), ("completions", "echo", "yes"),
])
def test_logprob_fields_out_of_range_are_refused_by_name(api, field, value):
    """top_logprobs 3 alone: it needs logprobs true (as OpenAI)."""
    cls, base = (ChatCompletionRequest, CHAT) if api == "chat" else (CompletionRequest, OK)
    err = refused(cls, {**base, field: value})
    assert err.status == 400 and err.param == field and err.code == "invalid_value"


def test_logprob_fields_become_engine_counts():
    chat = validate_request(ChatCompletionRequest, {**CHAT, "logprobs": True, "top_logprobs": 20})
    assert chat.sampling_kwargs(16)["logprobs"] == 20
    chat = validate_request(ChatCompletionRequest, {**CHAT, "logprobs": True})
    assert chat.sampling_kwargs(16)["logprobs"] == 0
    off = validate_request(ChatCompletionRequest, {**CHAT, "logprobs": None, "top_logprobs": 0})
    assert off.sampling_kwargs(16)["logprobs"] is None
    echo = validate_request(CompletionRequest, {**OK, "logprobs": 2, "echo": True}).sampling_kwargs(16)
    assert (echo["logprobs"], echo["prompt_logprobs"]) == (2, 2)
    plain = validate_request(CompletionRequest, {**OK, "logprobs": 0}).sampling_kwargs(16)
    assert (plain["logprobs"], plain["prompt_logprobs"]) == (0, None)
    text_only = validate_request(CompletionRequest, {**OK, "echo": True}).sampling_kwargs(16)
    assert (text_only["logprobs"], text_only["prompt_logprobs"]) == (None, None)


def test_unsupported_fields_at_their_off_value_are_accepted():
    off = {"best_of": 1, "echo": False, "tools": [], "tool_choice": "none",
           "logprobs": None, "suffix": None, "user": "u",
           "stream_options": {"include_usage": True}}
    assert validate_request(CompletionRequest, {**OK, **off}).model == "m"


def test_unknown_fields_are_refused_by_name():
    err = refused(CompletionRequest, {**OK, "temprature": 0.5})
    assert err.code == "unknown_parameter" and err.param == "temprature"
    err = refused(ChatCompletionRequest, {**CHAT, "messages": [
        {"role": "user", "content": "hi", "tool_calls": []}]})
    assert err.param == "messages[0].tool_calls"


def test_chat_messages():
    chat = validate_request(ChatCompletionRequest, {**CHAT, "max_completion_tokens": 5})
    assert chat.requested_max_tokens() == (5, "max_completion_tokens")
    assert chat.sampling_kwargs(16)["max_tokens"] == 5
    for messages in ([], [{"role": "user"}] * 513, [{"role": "robot", "content": "x"}],
                     [{"role": "user", "content": 5}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]):
        assert refused(ChatCompletionRequest, {**CHAT, "messages": messages}).param \
            .startswith("messages")
    err = refused(ChatCompletionRequest, {**CHAT, "max_completion_tokens": True})
    assert err.param == "max_completion_tokens"


def test_json_depth_and_bad_json():
    assert json_depth(b'{"a": [1, {"b": "[[[[[[\\"]]"}]}', 99) == 3
    deep = b"[" * 20_000 + b"]" * 20_000
    assert json_depth(deep, 16) == 17           # stops counting past the limit
    for raw in (deep, b'{"a":' * 20_000 + b"1" + b"}" * 20_000):
        with pytest.raises(HTTPError) as info:
            parse_json_object(raw, 16)
        assert info.value.status == 400 and info.value.code == "json_too_deep"
    for raw in (b"{not json", b"[1, 2]", b'"x"', b"\xff\xfe{}", b'{"a": 1' + b"9" * 5000 + b"}",
                b""):
        with pytest.raises(HTTPError) as info:
            parse_json_object(raw, 16)
        assert info.value.status == 400 and info.value.code == "invalid_json"


@pytest.mark.parametrize("raw", [
    b'{"model": "\\ud800", "prompt": "x"}', b'{"model": "m", "prompt": "a\\udfffb"}',
    b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d"}]}',
    b'{"model": "m", "prompt": "x", "\\ud800": 1}',
    b'{"model": "m", "prompt": "\xed\xa0\x80"}',     # UTF-8 of a surrogate: json lets it pass
    b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
])
def test_lone_surrogates_are_refused(raw):
    with pytest.raises(HTTPError) as info:
        parse_json_object(raw, 16)
    assert info.value.status == 400 and info.value.code == "invalid_unicode"
    assert b"\\ud" not in info.value.response().body      # the input is not echoed


def test_valid_unicode_passes():
    text = "emoji \U0001F600 rtl \u202e\u05e9\u05dc\u05d5\u05dd nul \u0000 \ufffd"
    raw = json.dumps({"model": "m", "prompt": text}).encode()
    assert validate_request(CompletionRequest, parse_json_object(raw, 16)).prompt == text
    raw = b'{"model": "m", "prompt": "\\ud83d\\ude00"}'         # an escaped pair is fine
    assert parse_json_object(raw, 16)["prompt"] == "\U0001F600"


class _Request:
    def __init__(self, body: bytes, declared: str | None = None, chunk: int = 1000):
        self.headers = {} if declared is None else {"content-length": declared}
        self._body, self._chunk = body, chunk

    async def stream(self):
        for i in range(0, len(self._body), self._chunk):
            yield self._body[i:i + self._chunk]


def test_body_bytes_capped_before_parsing():
    assert asyncio.run(read_body(_Request(b"x" * 2048), 2048)) == b"x" * 2048
    for request in (_Request(b"x" * 10, declared="99999"), _Request(b"x" * 5000)):
        with pytest.raises(HTTPError) as info:
            asyncio.run(read_body(request, 2048))
        assert info.value.status == 413


def test_admission_limit_and_drain():
    admission = Admission(max_in_flight=2, retry_after="1")
    first, second = admission.enter(), admission.enter()
    with pytest.raises(HTTPError) as info:
        admission.enter()
    assert info.value.status == 429 and info.value.headers["Retry-After"] == "1"
    first.release()
    first.release()                                 # idempotent
    assert admission.in_flight == 1
    admission.draining = True
    with pytest.raises(HTTPError) as info:
        admission.enter()
    assert info.value.status == 503 and info.value.code == "shutting_down"
    second.release()
    assert admission.in_flight == 0


def test_admission_ticket_released_when_an_unstarted_stream_is_dropped():
    import gc

    admission = Admission(max_in_flight=4, retry_after="1")

    async def events():
        yield "x"

    stream = events()
    admission.enter().release_with(stream)
    assert admission.in_flight == 1
    del stream
    gc.collect()
    assert admission.in_flight == 0


def test_ingress_limit_below_serve_limit():
    with pytest.raises(ValueError, match="max_in_flight"):
        AppConfig.model_validate({"target": {"model": "/m"}, "limits": {
            "max_in_flight": 300, "max_ongoing_requests": 256}})


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("model_cls,base", [(CompletionRequest, OK), (ChatCompletionRequest, CHAT)])
def test_processing_fields_reach_the_sampling_params(model_cls, base):
    body = {**base, "presence_penalty": -2, "frequency_penalty": 1.5, "repetition_penalty": 1.2,
            "logit_bias": {"0": -100, "17": 100, "300": 2.5},
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "thing", "schema": SCHEMA,
                                                "strict": True}}}
    kw = validate_request(model_cls, body).sampling_kwargs(16)
    assert (kw["presence_penalty"], kw["frequency_penalty"], kw["repetition_penalty"]) == (-2, 1.5, 1.2)
    assert kw["logit_bias"] == {"0": -100, "17": 100, "300": 2.5}
    assert json.loads(kw["json_schema"]) == SCHEMA
    kw = validate_request(model_cls, {**base, "response_format": {"type": "json_object"}}) \
        .sampling_kwargs(16)
    assert json.loads(kw["json_schema"]) == {"type": "object"}
    for off in ({}, {"response_format": {"type": "text"}, "logit_bias": {}, "presence_penalty": 0}):
        kw = validate_request(model_cls, {**base, **off}).sampling_kwargs(16)
        assert kw["json_schema"] is None and not kw["logit_bias"] and kw["presence_penalty"] == 0


@pytest.mark.parametrize("field,value,param", [
    ("presence_penalty", 2.01, "presence_penalty"), ("presence_penalty", "1", "presence_penalty"),
    ("frequency_penalty", -2.5, "frequency_penalty"), ("repetition_penalty", 0, "repetition_penalty"),
    ("repetition_penalty", 2.5, "repetition_penalty"), ("logit_bias", {"7": 100.5}, "logit_bias.7"),
    ("logit_bias", {"x": 1}, "logit_bias.x"), ("logit_bias", {"-1": 1}, "logit_bias"),
    ("logit_bias", {"1": True}, "logit_bias.1"), ("logit_bias", [1], "logit_bias"),
    ("logit_bias", {str(i): 1 for i in range(301)}, "logit_bias"),
    ("response_format", {"type": "xml"}, "response_format.type"),
    ("response_format", {"type": "json_schema"}, "response_format"),
    ("response_format", {"type": "json_object", "json_schema": {"name": "a", "schema": {}}},
     "response_format"),
    ("response_format", {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
     "response_format.json_schema.name"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}},
     "response_format.json_schema.name"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "a", "schema": "{}"}},
     "response_format.json_schema.schema"),
    ("response_format", {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"enum": ["x" * 1000] * 70}}}, "response_format.json_schema.schema"),
])
def test_processing_fields_out_of_range_name_the_field(field, value, param):
    err = refused(ChatCompletionRequest, {**CHAT, field: value})
    assert err.param == param, (err.param, err.message)
    assert err.code in ("invalid_value", "missing_required_parameter")
