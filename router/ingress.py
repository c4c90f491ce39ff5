"""The HTTP front door: OpenAI-compatible routes under Ray Serve, with auth, tiers and prices.

Per request: key -> plan (401/403), body -> pydantic (400), model name (404), then
`choose_tier(request, live stats, state)` -> the target replicas (speculative or baseline
mode) or the small replicas, streamed back as JSON or SSE with `usage` (tokens, tier, reason,
price_usd) and `x-specserve-tier` / `x-specserve-reason` headers. Overload is a 429 with
Retry-After: the ingress's own admission limit (`router/admission.py`, below its Serve
`max_ongoing_requests`, so Serve's plain-text 429 is never reached), Serve's
`BackPressureError` from a tier's bounded queue, or the engine's own full waiting queue. A
client that disconnects cancels the stream; the replica frees its KV. Every error, from a
route, FastAPI, an unknown path or a stream that fails midway (an SSE error event, then
`[DONE]`), is in OpenAI's shape; exception text never reaches a client (it is logged with the
request id). `drain()` stops admitting (503 + Retry-After) for a graceful stop.

Owns: routes, auth, error bodies, SSE framing. A request ends in one place, however it ends
(`router/lifecycle.py`: ok, client_gone or error; its ledger record, metrics and admission
ticket). Does not own the decision (`router/policy.py`), the stats gathering
(`router/live_stats.py`) nor generation (`deployments/`). Never imports torch.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import random
import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.responses import Response

from router import admin, policy
from router.accounting import Accounting
from router.admission import Admission
from router.capture import CaptureBuffer, chat_text
from router.config import AppConfig
from router.http_app import app, chain, endpoint_plan, routes
from router.lifecycle import IngressMetrics, RequestLife
from router.live_stats import LiveStats, mark_down
from router.logprobs import ChoiceLogprobs, chunk_logprobs, merge
from router.observer import Observer
from router.openai_schema import (ERROR_TYPES, ChatCompletionRequest, CompletionRequest, HTTPError,
                                  RunningUsage, choice, error_body, new_id, response_body,
                                  stream_chunk, system_fingerprint)
from router.plans import check_speculation, effective_plan, plan_covers
from router.validation import parse_json_object, read_body, validate_request
from router.wire import GenerateChunk, GenerateRequest, combined, find_tier_error

logger = logging.getLogger("ray.serve")
DOWN_CODES = ("replica_restarting", "replica_failed")     # the replica's engine is down
DOWN_RETRY_DELAYS_S = (0.2, 0.5, 1.0)    # then again, while the stats catch up (one period)
WAKE_TIMEOUT_S = 300.0    # how long a call that wakes a cold tier waits for its first replica
LOST_CHECK_S = 0.5        # how often a call waiting for its first chunk checks its tier is alive


def deployment_kind(tier: str) -> str:
    """The deployment that serves a tier: the small model's, or the target's (speculative and
    baseline)."""
    return "small" if tier == "small" else "target"


class TierLost(HTTPError):
    """The tier of a call that had not started lost its last live replica (router/ingress.py:
    `Ingress._first`); answered as a 503 unless the call goes to another tier."""

    def __init__(self, tier: str, retry_after: str):
        super().__init__(503, f"the {tier} tier has no live replica (its node or process is "
                         "gone) and the request may not go to another tier; retry",
                         "tier_down", headers={"Retry-After": retry_after})
FALLBACK_TIER = {"premium": "speculative", "standard": "baseline", "economy": "small",
                 "auto": "baseline"}


class Ingress:
    def __init__(self, config: AppConfig, target_handle, small_handle=None, alignment=None):
        self.cfg = config if isinstance(config, AppConfig) else AppConfig.model_validate(config)
        self.accounts = Accounting(self.cfg)     # live keys, rate limits, prices, ledger
        self.keys = self.accounts.keys
        self.handles = {"target": target_handle}
        if small_handle is not None:
            self.handles["small"] = small_handle
        self.alignment = alignment              # the alignment loop's handle, where it runs
        self.policy_config = self.cfg.policy
        self.policy_state = policy.PolicyState()
        self.probe_rng = random.Random()     # which auto requests probe (policy.probe_share)
        self.observer = Observer(self.policy_config.default_acceptance, tuple(self.handles),
                                 self.cfg.scales_to_zero)
        self._waking: set[str] = set()
        self._wake_tasks: set[asyncio.Task] = set()
        self.live = LiveStats(self.handles, self.observer, self.cfg.stats.period_s,
                              self.cfg.stats.stale_after_s)
        self.capture = CaptureBuffer(self.cfg.capture)      # off unless the config opts in
        self.retry_after = str(max(1, math.ceil(self.cfg.limits.retry_after_s)))
        self.admission = Admission(self.cfg.limits.max_in_flight, self.retry_after)
        self.metrics = IngressMetrics()
        try:
            self.live.start()
        except RuntimeError:    # no running loop here: the first health check or request starts it
            pass

    def draft_figures(self, since: float = 0.0, last: int | None = None) -> dict:
        """Live acceptance and goodput per draft and prompt class, from this ingress replica's
        requests (router/draft_live.py)."""
        return {"drafts": self.observer.drafts.as_dict(since, last), "time": time.time()}

    def draft_swapped(self) -> dict:
        """A new draft serves now: per-class acceptance learnt on the old one no longer holds."""
        return {"reset_classes": self.observer.draft_swapped()}

    # -- plumbing -----------------------------------------------------------------------------
    def _auth(self, request: Request) -> tuple[str, object]:
        """The plan this request runs under and the key record; raises 401 / 403."""
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else ""
        endpoint = endpoint_plan(request)
        if not key:
            if self.cfg.auth.require_key:
                raise HTTPError(401, "missing API key: send 'Authorization: Bearer <key>' "
                                "(create one with `specserve keys add`)", "missing_api_key")
            return effective_plan(self.cfg.auth.default_plan, endpoint), None
        record = self.keys.lookup(key)
        if record is None:
            raise HTTPError(401, "invalid API key", "invalid_api_key")
        if record.role == "admin":
            raise HTTPError(403, "admin keys manage keys (/admin/keys); they do not call models",
                            "admin_key")
        if not plan_covers(record.plan, endpoint):
            raise HTTPError(403, f"the key's plan '{record.plan}' does not cover the "
                            f"/{endpoint}/v1 endpoint", "plan_not_allowed")
        return effective_plan(record.plan, endpoint), record

    async def _body(self, request: Request, model_cls):
        """Bytes (bounded) -> JSON (depth-bounded, valid Unicode) -> strict model -> limits."""
        limits = self.cfg.limits
        raw = await read_body(request, limits.max_body_bytes)
        body = validate_request(model_cls, parse_json_object(raw, limits.max_json_depth))
        if body.model not in self.cfg.served_model_names:
            raise HTTPError(404, f"the model '{body.model}' does not exist; available: "
                            f"{self.cfg.served_model_names}", "model_not_found", "model")
        max_tokens, field = body.requested_max_tokens()
        if (max_tokens or 0) > limits.max_tokens_limit:
            raise HTTPError(400, f"{field} must be at most {limits.max_tokens_limit}",
                            "invalid_value", field)
        if body.n > limits.max_n:
            raise HTTPError(400, f"n must be at most {limits.max_n}", "invalid_value", "n")
        return body

    def _failure(self, exc: BaseException, tier: str, request_id: str) -> HTTPError:
        """What a client is told when a tier call fails: the replica's own `TierError`, or a
        503 with Retry-After for a genuine replica failure (its details go to the log only)."""
        err = find_tier_error(exc)
        if err is None:
            logger.error("request %s: the %s tier failed", request_id, tier, exc_info=exc)
            return HTTPError(503, f"the {tier} tier failed while serving request {request_id}; "
                             "retry", "replica_failed", headers={"Retry-After": self.retry_after})
        retry = str(math.ceil(err.retry_after)) if err.retry_after else self.retry_after
        headers = {"Retry-After": retry} if err.status in (429, 503) else None
        return HTTPError(err.status, err.message, err.code, err.param, headers)

    def _decide(self, plan: str, body, text: str, prompt_len: int, max_tokens: int):
        req = policy.TierRequest(plan=plan, speculation=body.speculation,
                                 allow_downgrade=body.allow_downgrade,
                                 prompt_class=policy.classify_prompt(text),
                                 prompt_tokens=prompt_len, max_tokens=max_tokens,
                                 probe=self.probe_rng.random() < self.policy_config.probe_share)
        try:
            decision = policy.choose_tier(req, self.observer.cluster_stats(), self.policy_state,
                                          self.policy_config)
            self.policy_state = decision.state
            tier, k_max, reason = decision.tier, decision.k_max, decision.reason
        except Exception:       # a policy bug must not take the API down: serve by plan
            logger.exception("choose_tier failed; falling back to the plan's tier")
            tier = FALLBACK_TIER[plan]
            k_max, reason = (self.policy_config.k_max if tier == "speculative" else 0), "policy_error"
        if tier == "small" and "small" not in self.handles:
            tier, reason = "baseline", "no_small_tier"
        if reason == "small_cold":
            self._wake("small")
        self.metrics.decided(tier, reason)
        return tier, k_max, reason, req.prompt_class

    def _wake(self, kind: str) -> None:
        """Start a replica of a tier scaled to zero: a call waiting at its handle is what Serve's
        autoscaler starts one for (router/autoscaling.py, `cold_start`). One at a time."""
        if kind in self._waking:
            return
        self._waking.add(kind)

        async def wake():
            try:
                await asyncio.wait_for(self.handles[kind].ready.remote(), WAKE_TIMEOUT_S)
            except Exception as exc:       # the next cold request tries again
                logger.warning("waking the %s tier: %r", kind, exc)
            finally:
                self._waking.discard(kind)
        task = asyncio.get_running_loop().create_task(wake())
        self._wake_tasks.add(task)              # the loop keeps only a weak reference
        task.add_done_callback(self._wake_tasks.discard)

    async def _start(self, gen_req: GenerateRequest):
        """Send to the tier and wait for the first chunk, so errors become HTTP statuses. A
        replica whose engine is down answers at once, before the routers' stats say so (up to
        a stats period): the request, which has not run, goes again, to another replica of
        the tier where it has one (the router ranks the replica that answered so last:
        `live_stats.mark_down`)."""
        kind = deployment_kind(gen_req.tier)
        for delay in DOWN_RETRY_DELAYS_S + (None,):
            stream = self.handles[kind].options(stream=True).generate.remote(gen_req)
            try:
                return await self._first(stream, kind, gen_req.tier), stream
            except TierLost:
                raise
            except BackPressureError as exc:
                raise HTTPError(429, f"the {gen_req.tier} tier is busy: {exc}; retry later",
                                "overloaded", headers={"Retry-After": self.retry_after}) from None
            except StopAsyncIteration:
                return GenerateChunk(text="", finished=True, finish_reason="abort"), stream
            except Exception as exc:
                err = find_tier_error(exc)
                down = err is not None and err.code in DOWN_CODES
                if down and err.replica:
                    mark_down(err.replica)
                if delay is None or not down or len(self.observer.replicas.get(kind, {})) < 2:
                    raise self._failure(exc, gen_req.tier, gen_req.request_id) from None
            await asyncio.sleep(delay)

    async def _first(self, stream, kind: str, tier: str):
        """The stream's first chunk. A call waits at the tier's handle while Serve has no
        replica to give it, as when the replica's node died (until Serve places it again:
        seconds to minutes). If the tier is lost while the call waits, the call is given up
        before any byte went out (`TierLost`)."""
        first = asyncio.ensure_future(stream.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({first}, timeout=LOST_CHECK_S)
                if done:
                    return first.result()
                if self.observer.lost(kind):
                    raise TierLost(tier, self.retry_after)
        finally:
            if not first.done():
                first.cancel()
                stream.cancel()

    async def _start_routed(self, life: RequestLife, gen_req: GenerateRequest, decide):
        """`_start`; where the tier is lost before the first chunk, the request is decided
        again (the policy routes around a tier that is down: `tier_down`) and sent once more,
        or answered 503 where it may go nowhere else."""
        try:
            return await self._start(gen_req)
        except TierLost as lost:
            kind = deployment_kind(gen_req.tier)
            life.tier, k_max, reason, _ = decide()
            if deployment_kind(life.tier) == kind:
                raise lost from None
        logger.warning("request %s: the %s tier was lost; sent to %s (%s)", gen_req.request_id,
                       kind, life.tier, reason)
        gen_req.tier, gen_req.k_max = life.tier, k_max
        gen_req.mode = "speculative" if life.tier == "speculative" else "baseline"
        life.charge.tier, life.charge.reason, life.charge.requested_mode = (
            life.tier, reason, gen_req.mode)
        return await self._start(gen_req)

    async def _serve(self, request: Request, chat: bool) -> Response:
        api = "chat" if chat else "completions"
        request_id = new_id("chatcmpl" if chat else "cmpl")
        self.live.start()
        life = RequestLife(self.accounts, self.metrics, self.observer, api, request_id)
        async with life:
            life.ticket = self.admission.enter()
            plan, key = self._auth(request)
            body = await self._body(request, ChatCompletionRequest if chat else CompletionRequest)
            check_speculation(plan, body.speculation)
            sampling = body.sampling_kwargs(self.cfg.limits.max_tokens_default)
            if chat:
                messages = body.plain_messages()
                text, prompt_len = messages[-1]["content"], sum(len(m["content"]) for m in messages) // 4
            elif isinstance(body.prompt, list):
                text, prompt_len = "", len(body.prompt)
            else:
                text, prompt_len = body.prompt, len(body.prompt) // 4
            decide = functools.partial(self._decide, plan, body, text, prompt_len,
                                       sampling["max_tokens"])
            life.tier, k_max, reason, life.prompt_class = decide()
            self.capture.offer(plan, chat_text(messages) if chat else text, life.prompt_class,
                               self.observer.acceptance_by_class(learnt_only=True))
            life.charge = await self.accounts.admit(request_id, key, plan, endpoint_plan(request),
                                                    api, life.tier, reason,
                                                    prompt_len + body.n * sampling["max_tokens"])
            gen_req = GenerateRequest(
                request_id=request_id, tier=life.tier, k_max=k_max, sampling=sampling,
                mode="speculative" if life.tier == "speculative" else "baseline",
                messages=messages if chat else None,
                prompt=body.prompt if not chat and isinstance(body.prompt, str) else None,
                prompt_token_ids=body.prompt if not chat and isinstance(body.prompt, list) else None,
                echo=bool(getattr(body, "echo", False)), n=body.n)
            first, life.stream = await self._start_routed(life, gen_req, decide)
            life.last = first
            headers = {"x-specserve-tier": life.tier, "x-specserve-reason": life.charge.reason,
                       **life.charge.headers}
            if body.stream:
                running = bool(body.stream_options and body.stream_options.continuous_usage_stats)
                events = self._sse(life, first, chat, body, running)
                return life.hand_off(StreamingResponse(events, media_type="text/event-stream",
                                                       headers=headers))
            return await self._collect(life, first, chat, body, headers)
        return life.response            # the request ended in an error (`RequestLife`)

    async def _collect(self, life: RequestLife, first, chat: bool, body, headers: dict):
        """The whole response of a request that is not streamed: every choice's text, token
        ids and logprobs, gathered chunk by chunk."""
        asked = body.logprob_count() is not None
        choices: dict[int, _Choice] = {}
        lasts: dict[int, GenerateChunk] = {}
        try:
            async for chunk in chain(first, life.stream):
                c = choices.setdefault(chunk.index, _Choice(chat, asked))
                c.parts.append((chunk.prompt_text or "") + chunk.text)
                c.token_ids += chunk.token_ids
                c.logprobs = merge(c.logprobs, chunk_logprobs(c.view, chunk))
                lasts[chunk.index] = chunk
                life.last = combined([lasts[i] for i in sorted(lasts)])
        except Exception as exc:
            raise self._failure(exc, life.tier, life.request_id) from None
        last = life.last
        usage = await life.finish(last)
        headers["x-specserve-reason"] = usage.reason       # the engine may have changed it
        ids = body.return_token_ids
        entries = [choice(chat, i, "".join(c.parts), lasts[i].finish_reason,
                          c.token_ids if ids else None, c.logprobs)
                   for i, c in sorted(choices.items())]
        fingerprint = system_fingerprint(self.cfg.model_name, last.fingerprint)
        return JSONResponse(response_body(chat, life.request_id, body.model, entries, usage,
                                          fingerprint), headers=headers)

    async def _sse(self, life: RequestLife, first, chat, body, running_usage=False):
        """The response's SSE events; `life` ends the request when the stream ends."""
        model, return_ids = body.model, body.return_token_ids
        asked = body.logprob_count() is not None
        views: dict[int, ChoiceLogprobs] = {}
        lasts: dict[int, GenerateChunk] = {}
        async with life:
            try:
                completion_tokens = 0
                async for chunk in chain(first, life.stream):
                    is_first = chunk.index not in lasts
                    lasts[chunk.index] = chunk
                    life.last = combined([lasts[i] for i in sorted(lasts)])
                    completion_tokens += len(chunk.token_ids)
                    view = views.setdefault(chunk.index, ChoiceLogprobs(chat)) if asked else None
                    logprobs = chunk_logprobs(view, chunk)
                    text = (chunk.prompt_text or "") + chunk.text
                    if not (text or chunk.finished or is_first or (return_ids and chunk.token_ids)
                            or (logprobs and chunk.logprobs)):
                        continue        # nothing to say yet (the detokenizer holds bytes back)
                    usage = await life.finish(life.last) if chunk.done else None
                    if usage is None and running_usage:
                        usage = RunningUsage(chunk.num_prompt_tokens, completion_tokens)
                    fingerprint = system_fingerprint(self.cfg.model_name, chunk.fingerprint)
                    data = stream_chunk(chat, life.request_id, model, chunk.index, text,
                                        chunk.finish_reason, usage, is_first,
                                        chunk.token_ids if return_ids else None, fingerprint,
                                        logprobs)
                    yield f"data: {json.dumps(data)}\n\n"
                    if chunk.done:
                        break
            except Exception as exc:    # mid-stream: an error event, then the end marker
                life.error = self._failure(exc, life.tier, life.request_id)
                err = life.error
                body = error_body(err.message, ERROR_TYPES.get(err.status, "server_error"),
                                  err.code, err.param)
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"

    # -- routes -------------------------------------------------------------------------------
    @routes("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    @routes("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    @routes("/v1/models", method="get")
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
    async def health(self, request: Request) -> Response:
        self.live.start()
        tiers = self.observer.health(profile=request.query_params.get("profile") == "1")
        # a tier scaled to zero serves through another (small_cold): the service is up
        ready = all(t["replicas"] > 0 or kind in self.cfg.scales_to_zero
                    for kind, t in tiers.items())
        status = "draining" if self.admission.draining else "ok" if ready else "starting"
        body = {"status": status}
        if admin.is_admin(self.keys, request):      # details (replica ids, load): admins only
            body["tiers"] = tiers
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.api_route("/admin/{path:path}", methods=["GET", "POST", "DELETE"])
    async def admin_routes(self, request: Request, path: str) -> Response:
        return await admin.handle(self.accounts, request, path)

    async def drain(self) -> int:
        """Stop admitting (new requests: 503 + Retry-After); returns the requests in flight."""
        self.admission.draining = True
        return self.admission.in_flight

    async def in_flight(self) -> int:
        return self.admission.in_flight

    async def check_health(self) -> None:
        self.live.start()     # the first health check runs on the replica's loop: start polling


class _Choice:
    """One choice of a response that is not streamed, as its chunks come in."""

    def __init__(self, chat: bool, logprobs: bool):
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self.view = ChoiceLogprobs(chat) if logprobs else None
        self.logprobs = self.view.part([]) if self.view else None


IngressDeployment = serve.deployment(serve.ingress(app)(Ingress), name="Ingress")
