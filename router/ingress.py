"""The HTTP front door: OpenAI-compatible routes under Ray Serve, with auth, tiers and prices.

Per request: key -> plan (401/403), body -> pydantic (400), model name (404), then
`choose_tier(request, live stats, state)` -> the target replicas (speculative or baseline
mode) or the small replicas, streamed back as JSON or SSE with `usage` (tokens, tier, reason,
price_usd) and `x-specserve-tier` / `x-specserve-reason` headers. Overload is a 429 with
Retry-After: Serve's `BackPressureError` from a tier's bounded queue, or the engine's own
full waiting queue. A client that disconnects cancels the stream; the replica frees its KV.

Owns: routes, auth, error bodies, SSE framing, the ingress metrics (tier decisions and
requests by status). Does not own the decision (`router/policy.py`), the stats gathering
(`router/live_stats.py`) nor generation (`deployments/`). Never imports torch.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
import logging
import math
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve import metrics
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from router import policy
from router.config import AppConfig
from router.keys import KeyStore
from router.live_stats import LiveStats, to_cluster_stats
from router.openai_schema import (ERROR_TYPES, ChatCompletionRequest, CompletionRequest, HTTPError,
                                  Usage, chat_body, chat_chunk, completion_body, completion_chunk,
                                  error_body, new_id)
from router.pricing import PriceTable, effective_plan, plan_covers
from router.wire import GenerateChunk, GenerateRequest, find_tier_error

logger = logging.getLogger("ray.serve")
ENDPOINT_PLANS = ("premium", "standard", "economy")
FALLBACK_TIER = {"premium": "speculative", "standard": "baseline", "economy": "small",
                 "auto": "baseline"}
PREFIXES = ("",) + tuple(f"/{p}" for p in ENDPOINT_PLANS)

app = FastAPI(title="specserve", docs_url=None, redoc_url=None)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown paths and methods answer in OpenAI's error shape too."""
    type_ = ERROR_TYPES.get(exc.status_code, "invalid_request_error")
    return JSONResponse(error_body(str(exc.detail), type_, "not_found" if exc.status_code == 404
                                   else "method_not_allowed" if exc.status_code == 405 else None),
                        status_code=exc.status_code)


def _routes(suffix: str, method: str = "post"):
    """Register one handler on `/v1/...` and on every pricing prefix."""
    def wrap(fn):
        for prefix in PREFIXES:
            getattr(app, method)(prefix + suffix)(fn)
        return fn
    return wrap


def _endpoint_plan(request: Request) -> str:
    first = request.url.path[len(request.scope.get("root_path", "")):].lstrip("/").split("/")[0]
    return first if first in ENDPOINT_PLANS else "auto"


async def _chain(first, stream):
    yield first
    if not first.finished:
        async for chunk in stream:
            yield chunk


class Ingress:
    def __init__(self, config: dict, target_handle, small_handle=None):
        self.cfg = AppConfig.model_validate(config)
        self.keys = KeyStore.from_config(self.cfg.auth)
        self.prices = PriceTable.from_config(self.cfg.prices)
        self.handles = {"target": target_handle}
        if small_handle is not None:
            self.handles["small"] = small_handle
        self.live = LiveStats(self.handles, self.cfg.stats.period_s, self.cfg.stats.stale_after_s)
        self.policy_config = policy.PolicyConfig(**self.cfg.policy)
        self.policy_state = policy.PolicyState()
        self.acceptance_by_class: dict[str, float] = {}     # per-token a, EWMA per class
        self.recent_acceptance: deque[float] = deque(maxlen=64)  # a of finished spec requests
        self.recent_lengths: deque[tuple[int, int]] = deque(maxlen=64)  # (prompt, output)
        self.retry_after = str(max(1, math.ceil(self.cfg.limits.retry_after_s)))
        self.m_decisions = metrics.Counter("specserve_tier_decisions", tag_keys=("tier", "reason"),
                                           description="Tier decisions by tier and reason.")
        self.m_requests = metrics.Counter("specserve_requests", tag_keys=("status", "tier", "api"),
                                          description="Finished HTTP requests by status code.")
        self.m_price = metrics.Counter("specserve_price_usd", tag_keys=("tier",),
                                       description="USD charged, by tier.")
        try:
            self.live.start()
        except RuntimeError:    # no running loop here: the first health check or request starts it
            pass

    # -- plumbing -----------------------------------------------------------------------------
    def _auth(self, request: Request) -> str:
        """The plan this request runs under; raises 401 / 403."""
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else ""
        endpoint = _endpoint_plan(request)
        if not key:
            if self.cfg.auth.require_key:
                raise HTTPError(401, "missing API key: send 'Authorization: Bearer <key>' "
                                "(create one with `specserve keys add`)", "missing_api_key")
            return effective_plan(self.cfg.auth.default_plan, endpoint)
        record = self.keys.lookup(key)
        if record is None:
            raise HTTPError(401, "invalid API key", "invalid_api_key")
        if not plan_covers(record.plan, endpoint):
            raise HTTPError(403, f"the key's plan '{record.plan}' does not cover the "
                            f"/{endpoint}/v1 endpoint", "plan_not_allowed")
        return effective_plan(record.plan, endpoint)

    async def _body(self, request: Request, model_cls):
        try:
            data = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise HTTPError(400, "the request body is not valid JSON", "invalid_json") from None
        if not isinstance(data, dict):
            raise HTTPError(400, "the request body must be a JSON object", "invalid_json")
        try:
            body = model_cls.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            raise HTTPError(400, f"{param}: {err['msg']}" if param else err["msg"],
                            "invalid_value", param) from None
        if body.model not in self.cfg.served_model_names:
            raise HTTPError(404, f"the model '{body.model}' does not exist; available: "
                            f"{self.cfg.served_model_names}", "model_not_found", "model")
        if (body.max_tokens or 0) > self.cfg.limits.max_tokens_limit:
            raise HTTPError(400, f"max_tokens must be at most {self.cfg.limits.max_tokens_limit}",
                            "invalid_value", "max_tokens")
        return body

    def _decide(self, plan: str, body, text: str, prompt_len: int, max_tokens: int):
        req = policy.TierRequest(plan=plan, speculation=body.speculation,
                                 allow_downgrade=body.allow_downgrade,
                                 prompt_class=policy.classify_prompt(text),
                                 prompt_tokens=prompt_len, max_tokens=max_tokens)
        try:
            stats = to_cluster_stats(self.live.snapshots(), self.acceptance_by_class,
                                     self._recent())
            decision = policy.choose_tier(req, stats, self.policy_state, self.policy_config)
            self.policy_state = decision.state
            tier, k_max, reason = decision.tier, decision.k_max, decision.reason
        except Exception:       # a policy bug must not take the API down: serve by plan
            logger.exception("choose_tier failed; falling back to the plan's tier")
            tier = FALLBACK_TIER[plan]
            k_max, reason = (self.cfg.target.k_max if tier == "speculative" else 0), "policy_error"
        if tier == "small" and "small" not in self.handles:
            tier, reason = "baseline", "no_small_tier"
        self.m_decisions.inc(tags={"tier": tier, "reason": reason})
        return tier, k_max, reason, req.prompt_class

    def _recent(self) -> dict:
        """What recently finished requests tell the policy (TierStats fields)."""
        out = {"acceptance_samples": tuple(self.recent_acceptance)}
        if self.recent_lengths:
            n = len(self.recent_lengths)
            out["mean_prompt_tokens"] = sum(p for p, _ in self.recent_lengths) / n
            out["mean_output_tokens"] = sum(o for _, o in self.recent_lengths) / n
        return out

    async def _start(self, gen_req: GenerateRequest):
        """Send to the tier and wait for the first chunk, so errors become HTTP statuses."""
        handle = self.handles["small" if gen_req.tier == "small" else "target"]
        stream = handle.options(stream=True).generate.remote(gen_req)
        try:
            first = await stream.__anext__()
        except BackPressureError as exc:
            raise HTTPError(429, f"the {gen_req.tier} tier is busy: {exc}; retry later",
                            "overloaded", headers={"Retry-After": self.retry_after}) from None
        except StopAsyncIteration:
            first = GenerateChunk(text="", finished=True, finish_reason="abort")
        except Exception as exc:
            tier_error = find_tier_error(exc)
            if tier_error is None:
                raise HTTPError(503, f"the {gen_req.tier} tier failed: {type(exc).__name__}; retry",
                                "replica_failed", headers={"Retry-After": self.retry_after}) from None
            headers = {"Retry-After": self.retry_after} if tier_error.status == 429 else None
            raise HTTPError(tier_error.status, tier_error.message, tier_error.code,
                            tier_error.param, headers) from None
        return first, stream

    def _usage(self, last: GenerateChunk, tier: str, reason: str, prompt_class: str) -> Usage:
        price = self.prices.price_usd(tier, last.num_prompt_tokens, last.num_output_tokens)
        self.m_price.inc(price, tags={"tier": tier}) if price > 0 else None
        a = last.token_acceptance
        if a is not None and tier == "speculative":
            old = self.acceptance_by_class.get(prompt_class, a)
            self.acceptance_by_class[prompt_class] = 0.9 * old + 0.1 * a
            self.recent_acceptance.append(a)
        if tier != "small":
            self.recent_lengths.append((last.num_prompt_tokens, last.num_output_tokens))
        return Usage(prompt_tokens=last.num_prompt_tokens, completion_tokens=last.num_output_tokens,
                     total_tokens=last.num_prompt_tokens + last.num_output_tokens, tier=tier,
                     reason=reason, price_usd=price, acceptance_rate=last.acceptance_rate,
                     mean_acceptance_length=last.mean_acceptance_length)

    async def _serve(self, request: Request, chat: bool) -> Response:
        api = "chat" if chat else "completions"
        tier = "none"
        self.live.start()
        try:
            plan = self._auth(request)
            body = await self._body(request, ChatCompletionRequest if chat else CompletionRequest)
            sampling = body.sampling_kwargs(self.cfg.limits.max_tokens_default)
            if chat:
                messages = body.plain_messages()
                text, prompt_len = messages[-1]["content"], sum(len(m["content"]) for m in messages) // 4
            elif isinstance(body.prompt, list):
                text, prompt_len = "", len(body.prompt)
            else:
                text, prompt_len = body.prompt, len(body.prompt) // 4
            tier, k_max, reason, prompt_class = self._decide(plan, body, text, prompt_len,
                                                             sampling["max_tokens"])
            request_id = new_id("chatcmpl" if chat else "cmpl")
            gen_req = GenerateRequest(
                request_id=request_id, tier=tier, k_max=k_max, sampling=sampling,
                mode="speculative" if tier == "speculative" else "baseline",
                messages=messages if chat else None,
                prompt=body.prompt if not chat and isinstance(body.prompt, str) else None,
                prompt_token_ids=body.prompt if not chat and isinstance(body.prompt, list) else None)
            first, stream = await self._start(gen_req)
        except HTTPError as err:
            self.m_requests.inc(tags={"status": str(err.status), "tier": tier, "api": api})
            return err.response()
        except Exception as exc:
            logger.exception("request failed")
            self.m_requests.inc(tags={"status": "500", "tier": tier, "api": api})
            return HTTPError(500, f"internal error: {type(exc).__name__}: {exc}",
                             "internal_error").response()
        headers = {"x-specserve-tier": tier, "x-specserve-reason": reason}
        ids = body.return_token_ids
        if body.stream:
            events = self._sse(first, stream, chat, body.model, request_id, tier, reason,
                               prompt_class, ids, api)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        parts, token_ids, last = [], [], first
        try:
            async for chunk in _chain(first, stream):
                parts.append(chunk.text)
                token_ids += chunk.token_ids
                last = chunk
        except Exception as exc:
            err = find_tier_error(exc)
            status = err.status if err else 503
            self.m_requests.inc(tags={"status": str(status), "tier": tier, "api": api})
            return HTTPError(status, err.message if err else f"generation failed: {exc}").response()
        finally:
            stream.cancel()     # no-op when exhausted; aborts the sequence if we are cancelled
        usage = self._usage(last, tier, reason, prompt_class)
        make = chat_body if chat else completion_body
        self.m_requests.inc(tags={"status": "200", "tier": tier, "api": api})
        return JSONResponse(make(request_id, body.model, "".join(parts), last.finish_reason, usage,
                                 token_ids if ids else None), headers=headers)

    async def _sse(self, first, stream, chat, model, request_id, tier, reason, prompt_class,
                   return_ids, api):
        status = "200"
        try:
            is_first = True
            async for chunk in _chain(first, stream):
                if not (chunk.text or chunk.finished or is_first or (return_ids and chunk.token_ids)):
                    continue            # nothing to say yet (the detokenizer holds bytes back)
                usage = self._usage(chunk, tier, reason, prompt_class) if chunk.finished else None
                ids = chunk.token_ids if return_ids else None
                if chat:
                    data = chat_chunk(request_id, model, chunk.text, chunk.finish_reason, usage,
                                      first=is_first, token_ids=ids)
                else:
                    data = completion_chunk(request_id, model, chunk.text, chunk.finish_reason,
                                            usage, ids)
                is_first = False
                yield f"data: {json.dumps(data)}\n\n"
                if chunk.finished:
                    break
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            status = "499"          # the client went away
            raise
        except Exception as exc:
            err = find_tier_error(exc)
            status = str(err.status if err else 500)
            body = error_body(err.message if err else f"generation failed: {type(exc).__name__}",
                              ERROR_TYPES.get(int(status), "server_error"))
            yield f"data: {json.dumps(body)}\n\n"
        finally:
            stream.cancel()         # Serve cancels the replica's generator -> engine.abort
            self.m_requests.inc(tags={"status": status, "tier": tier, "api": api})

    # -- routes -------------------------------------------------------------------------------
    @_routes("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    @_routes("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    @_routes("/v1/models", method="get")
    async def models(self, request: Request) -> Response:
        try:
            self._auth(request)
        except HTTPError as err:
            return err.response()
        created = int(time.time())
        data = [{"id": name, "object": "model", "created": created, "owned_by": "specserve"}
                for name in self.cfg.served_model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health(self) -> Response:
        self.live.start()
        tiers = {kind: {"replicas": len(s.replicas), "running": s.num_running,
                        "waiting": s.num_waiting, "kv_headroom": round(s.kv_headroom, 4),
                        "replica_ids": [r.replica_id for r in s.replicas], **_kv_and_acceptance(s)}
                 for kind, s in self.live.snapshots().items()}
        ready = all(t["replicas"] > 0 for t in tiers.values())
        return JSONResponse({"status": "ok" if ready else "starting", "tiers": tiers},
                            status_code=200 if ready else 503)

    async def check_health(self) -> None:
        self.live.start()     # the first health check runs on the replica's loop: start polling


def _kv_and_acceptance(snapshot) -> dict:
    """KV bytes held (target, draft) summed over a tier's replicas, and their live per-token
    acceptance: read-only numbers for `specserve bench serve` and operators."""
    reps = snapshot.replicas
    acc = [r.token_acceptance for r in reps if r.token_acceptance is not None]
    return {"kv_budget_bytes": sum(r.kv_budget_bytes for r in reps),
            "kv_used_target_bytes": sum(r.kv_used_target_bytes for r in reps),
            "kv_used_draft_bytes": sum(r.kv_used_draft_bytes for r in reps),
            "token_acceptance": sum(acc) / len(acc) if acc else None}


IngressDeployment = serve.deployment(serve.ingress(app)(Ingress), name="Ingress")
