"""The OpenAI-compatible wire format: request and response bodies, and the error body.

Owns validation of what a client sends (pydantic; a bad field becomes a 400 with
`{"error": {"message", "type", "code", "param"}}`) and the shape of what goes back, including
specserve's extensions: `speculation` (auto|on|off), `allow_downgrade`, `return_token_ids` on
requests; `tier`, `reason`, `price_usd` in `usage`. Does not own tokenization (the replicas do),
nor the choice of tier (`router/policy.py`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Request(BaseModel):
    # Unknown OpenAI fields (user, logit_bias, ...) are accepted and ignored, as vLLM does.
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(1, ge=1)
    logprobs: Any = None
    ignore_eos: bool = False
    # specserve extensions
    speculation: Literal["auto", "on", "off"] = "auto"
    allow_downgrade: bool = False
    return_token_ids: bool = False

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n = 1 is supported")
        return n

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any) -> Any:
        if value not in (None, False):
            raise ValueError("logprobs are not supported")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    def sampling_kwargs(self, max_tokens_default: int) -> dict:
        """Keyword arguments for `engine.sampling_params.SamplingParams`."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_tokens": self.max_tokens or max_tokens_default, "stop": list(self.stop or []),
                "ignore_eos": self.ignore_eos, "seed": self.seed}


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            prompt = prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt, list) and any(t < 0 for t in prompt):
            raise ValueError("prompt token ids must be non-negative")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):   # [{"type": "text", "text": ...}, ...]
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def sampling_kwargs(self, max_tokens_default: int) -> dict:
        kwargs = super().sampling_kwargs(max_tokens_default)
        if self.max_completion_tokens is not None:
            kwargs["max_tokens"] = self.max_completion_tokens
        return kwargs

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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def system_fingerprint(model_name: str, replica_fingerprint: str | None) -> str | None:
    """OpenAI's `system_fingerprint`: the model name and the replica's weights, numerics and
    sampler. A seeded request reproduces across answers that carry the same one."""
    if replica_fingerprint is None:
        return None
    import hashlib

    return "fp_" + hashlib.sha256(f"{model_name}|{replica_fingerprint}".encode()).hexdigest()[:12]


def completion_body(request_id: str, model: str, text: str, finish_reason: str | None,
                    usage: Usage | None, token_ids: list[int] | None = None,
                    fingerprint: str | None = None) -> dict:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": fingerprint, "choices": [choice]}
    if usage is not None:
        body["usage"] = usage.model_dump()
    return body


def chat_body(request_id: str, model: str, text: str, finish_reason: str | None,
              usage: Usage | None, token_ids: list[int] | None = None,
              fingerprint: str | None = None) -> dict:
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                              "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": fingerprint, "choices": [choice]}
    if usage is not None:
        body["usage"] = usage.model_dump()
    return body


def chat_chunk(request_id: str, model: str, text: str | None, finish_reason: str | None,
               usage: Usage | None = None, first: bool = False,
               token_ids: list[int] | None = None, fingerprint: str | None = None) -> dict:
    delta: dict[str, Any] = {}
    if first:
        delta["role"] = "assistant"
    if text:
        delta["content"] = text
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "system_fingerprint": fingerprint, "choices": [choice]}
    if usage is not None:
        body["usage"] = usage.model_dump()
    return body


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None,
                     usage: Usage | None = None, token_ids: list[int] | None = None,
                     fingerprint: str | None = None) -> dict:
    body = completion_body(request_id, model, text, finish_reason, usage, token_ids, fingerprint)
    return body


ErrorType = Literal["invalid_request_error", "authentication_error", "permission_error",
                    "not_found_error", "rate_limit_error", "server_error", "overloaded_error"]


def error_body(message: str, type_: ErrorType, code: str | None = None,
               param: str | None = None) -> dict:
    """OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 429: "rate_limit_error", 503: "overloaded_error"}


class HTTPError(Exception):
    """An error answered as an HTTP status with OpenAI's error body (and optional headers)."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        from fastapi.responses import JSONResponse

        body = error_body(self.message, ERROR_TYPES.get(self.status, "server_error"),
                          self.code, self.param)
        return JSONResponse(body, status_code=self.status, headers=self.headers)
