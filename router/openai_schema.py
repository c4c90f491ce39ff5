"""The OpenAI-compatible wire format: request and response bodies, and the error body.

Owns validation of what a client sends (pydantic, strict: no string or boolean is coerced into
a number or a flag; ranges as OpenAI documents them; bounded counts and lengths; OpenAI fields
that would change the output and are not implemented are refused by name; a bad field becomes
a 400 with `{"error": {"message", "type", "code", "param"}}`, see `router/validation.py`) and
the shape of what goes back, including
specserve's extensions: `speculation` (auto|on|off), `allow_downgrade`, `return_token_ids` on
requests, vLLM's `repetition_penalty`; `tier`, `reason`, `price_usd` in `usage`. Does not own tokenization (the replicas do),
nor the choice of tier (`router/policy.py`).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError


# Bounds on what one request may ask; each is stated in the error a client gets past it.
MAX_MODEL_NAME_CHARS = 256
MAX_STOP_STRINGS = 4              # as OpenAI
MAX_STOP_CHARS = 256
MAX_TOP_K = 1 << 20               # above any vocabulary: the engine clamps top_k to its vocab
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 63) - 1   # any signed 64-bit integer, as vLLM
MAX_TOKENS_HARD = (1 << 31) - 1   # the configured limit (limits.max_tokens_limit) is lower
MAX_PROMPT_TOKEN_IDS = 1 << 17
MAX_TOKEN_ID = (1 << 31) - 1      # the replica checks ids against its vocabulary
MAX_MESSAGES = 512
MAX_CONTENT_PARTS = 64
MAX_USER_CHARS = 256
MAX_LOGIT_BIAS = 300              # entries, as OpenAI
MAX_SCHEMA_CHARS = 1 << 16        # a response_format schema, as compact JSON text
JSON_OBJECT_SCHEMA = '{"type": "object"}'   # response_format json_object: any JSON object
MAX_TOP_LOGPROBS = 20             # chat's top_logprobs, as OpenAI
MAX_COMPLETION_LOGPROBS = 5       # completions' logprobs, as OpenAI
MAX_N = 128                       # choices, as OpenAI (the configured limit, limits.max_n, is lower)

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
StopList = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]

# OpenAI fields that would change the output and that specserve does not implement: accepted
# only at the value that means "off" (clients such as LangChain send those), refused otherwise
# with a 400 that names the field. Every other unknown field is refused as unrecognized.
UNSUPPORTED_UNLESS_OFF = {
    "best_of": (1,), "suffix": ("",), "tools": ([],), "tool_choice": ("none",),
    "functions": ([],), "function_call": ("none",), "parallel_tool_calls": (False,),
}


def _is_off(value: Any, off_values: tuple) -> bool:
    """`None` or one of `off_values`, with the same JSON type (`true` is not `1`)."""
    if value is None:
        return True
    return any(type(value) is type(off) and value == off
               or (isinstance(off, int) and not isinstance(off, bool)
                   and type(value) is float and value == off)
               for off in off_values)


BiasKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]     # a token id, as JSON keys are
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(None, max_length=MAX_SCHEMA_CHARS)
    schema_: dict = Field(alias="schema")
    strict: bool | None = None    # the grammar always holds the output to the schema

    @field_validator("schema_")
    @classmethod
    def _bounded(cls, value: dict) -> dict:
        if len(json.dumps(value, separators=(",", ":"))) > MAX_SCHEMA_CHARS:
            raise ValueError(f"the schema is longer than {MAX_SCHEMA_CHARS} characters as JSON")
        return value


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text, any JSON object, or JSON matching a schema (the
    replica compiles it with its tokenizer: engine/grammar.py)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with, and only with, type json_schema")
        return self

    def schema_text(self) -> str | None:
        """The JSON schema the output must match, as text; None for plain text."""
        if self.type == "json_object":
            return JSON_OBJECT_SCHEMA
        if self.type == "json_schema":
            return json.dumps(self.json_schema.schema_, separators=(",", ":"))
        return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = True    # usage is always sent in the final chunk
    # vLLM's extension (load clients such as guidellm send it): every chunk carries the token
    # counts so far; the final chunk's usage (with the price) is unchanged.
    continuous_usage_stats: bool = False


class _Request(BaseModel):
    """Fields common to both APIs, typed strictly: no string or boolean becomes a number."""
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str = Field(min_length=1, max_length=MAX_MODEL_NAME_CHARS)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_HARD)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)                   # 0 = off
    stop: StopString | StopList | None = None
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    ignore_eos: bool = False
    # Logits processing, applied alike to the draft's and the target's rows
    # (engine/logits_processors.py).
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)      # vLLM's extension; 1 = off
    logit_bias: dict[BiasKey, Bias] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    response_format: ResponseFormat | None = None
    # specserve extensions
    speculation: Literal["auto", "on", "off"] = "auto"
    allow_downgrade: bool = False
    return_token_ids: bool = False
    # the other API's log-probability fields: accepted here only when off (as above)
    unsupported_here: ClassVar[dict] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unsupported = UNSUPPORTED_UNLESS_OFF | cls.unsupported_here
            for name, off in unsupported.items():
                if name in data and not _is_off(data[name], off):
                    raise PydanticCustomError(
                        "unsupported", "{name} is not supported by this server (only "
                        "{off} or null is accepted)", {"name": name, "off": json.dumps(off[0])})
            return {k: v for k, v in data.items() if k not in unsupported}
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        return [value] if isinstance(value, str) else list(value or [])

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The output bound the caller asked for, and the field it came from."""
        return self.max_tokens, "max_tokens"

    def sampling_kwargs(self, max_tokens_default: int) -> dict:
        """Keyword arguments for `engine.sampling_params.SamplingParams`."""
        max_tokens = self.requested_max_tokens()[0]
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_tokens": max_tokens or max_tokens_default, "stop": list(self.stop or []),
                "ignore_eos": self.ignore_eos, "seed": self.seed,
                "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty,
                "repetition_penalty": self.repetition_penalty,
                "logit_bias": dict(self.logit_bias or {}),
                "json_schema": self.response_format.schema_text() if self.response_format else None,
                "logprobs": self.logprob_count(), "prompt_logprobs": self.prompt_logprob_count()}

    def logprob_count(self) -> int | None:
        """Alternatives per output token (None: no log-probabilities)."""
        return None

    def prompt_logprob_count(self) -> int | None:
        """Alternatives per prompt token (None: the prompt is not scored)."""
        return None


class CompletionRequest(_Request):
    unsupported_here: ClassVar[dict] = {"top_logprobs": (0,)}
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = False   # the prompt comes back in front of the text (and scored, with logprobs)

    def logprob_count(self) -> int | None:
        return self.logprobs

    def prompt_logprob_count(self) -> int | None:
        return self.logprobs if self.echo else None

    # One prompt: a string or token ids ([["..."]] and [[ids]] of length 1 are unwrapped).
    prompt: (str | Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]
             | Annotated[list[str], Field(min_length=1, max_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1,
                                                             max_length=MAX_PROMPT_TOKEN_IDS)]],
                         Field(min_length=1, max_length=1)])

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and not isinstance(prompt[0], int):
            prompt = prompt[0]
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = Field(None, max_length=MAX_USER_CHARS)

    def text(self) -> str:
        if isinstance(self.content, list):   # [{"type": "text", "text": ...}, ...]
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    unsupported_here: ClassVar[dict] = {"echo": (False,)}
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_HARD)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def plain_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    tier: str
    reason: str
    price_usd: float
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None


class RunningUsage(BaseModel):
    """Token counts so far, on every chunk of a stream that asked for `continuous_usage_stats`."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int = 0

    def __init__(self, prompt_tokens: int, completion_tokens: int):
        super().__init__(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def system_fingerprint(model_name: str, replica_fingerprint: str | None) -> str | None:
    """OpenAI's `system_fingerprint`: the model name and the replica's weights, numerics and
    sampler. A seeded request reproduces across answers that carry the same one."""
    if replica_fingerprint is None:
        return None
    import hashlib

    return "fp_" + hashlib.sha256(f"{model_name}|{replica_fingerprint}".encode()).hexdigest()[:12]


def choice(chat: bool, index: int, text: str, finish_reason: str | None,
           token_ids: list[int] | None = None, logprobs: dict | None = None) -> dict:
    """One entry of a response's `choices`."""
    out: dict[str, Any] = {"index": index}
    if chat:
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["text"] = text
    out |= {"logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def response_body(chat: bool, request_id: str, model: str, choices: list[dict],
                  usage: Usage | None, fingerprint: str | None = None) -> dict:
    """A whole (not streamed) chat or completions response."""
    body = {"id": request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "system_fingerprint": fingerprint,
            "choices": choices}
    if usage is not None:
        body["usage"] = usage.model_dump()
    return body


def stream_chunk(chat: bool, request_id: str, model: str, index: int, text: str | None,
                 finish_reason: str | None, usage: Usage | RunningUsage | None = None,
                 first: bool = False, token_ids: list[int] | None = None,
                 fingerprint: str | None = None, logprobs: dict | None = None) -> dict:
    """One SSE event's data: choice `index`'s delta (its first says the role, in chat)."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        entry: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish_reason}
        if token_ids is not None:
            entry["token_ids"] = token_ids
    else:
        entry = choice(False, index, text or "", finish_reason, token_ids, logprobs)
    body = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "system_fingerprint": fingerprint,
            "choices": [entry]}
    if usage is not None:
        body["usage"] = usage.model_dump()
    return body


ErrorType = Literal["invalid_request_error", "authentication_error", "permission_error",
                    "not_found_error", "rate_limit_error", "server_error", "overloaded_error"]


def error_body(message: str, type_: ErrorType, code: str | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "overloaded_error"}


class HTTPError(Exception):
    """An error answered as an HTTP status with OpenAI's error body (and optional headers)."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def response(self):
        """A JSON response; ASCII-escaped, so no string can fail to encode on the way out."""
        from starlette.responses import Response

        body = error_body(self.message, ERROR_TYPES.get(self.status, "server_error"),
                          self.code, self.param)
        return Response(json.dumps(body), status_code=self.status, headers=self.headers,
                        media_type="application/json")
