"""What every tier replica does, whatever its model: tokenize, run the engine, stream chunks.

`EngineServer` takes its engine class as a parameter (an import path, `AsyncEngine` by
default), so the deployment stays thin: it turns a `router.wire.GenerateRequest` into
`engine.generate(...)`, streams `GenerateChunk`s, maps engine errors to `TierError`s with an HTTP
status, aborts the sequence in `finally` (a client that disconnects makes Serve cancel the
generator, and the KV is freed at once), reports its stats through `record_routing_stats`
and exports metrics. No tensor math here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import AsyncIterator

from deployments.metrics import ReplicaMetrics
from deployments.siblings import merged
from deployments.tp_group import import_object
from router.config import TierModelConfig
from router.wire import GenerateChunk, TierError, GenerateRequest

logger = logging.getLogger(__name__)

ENGINE_CLASS = "engine.async_engine:AsyncEngine"
PROCESS_ENGINE_CLASS = "engine.engine_core:ProcessEngine"
RESTART_WINDOW_S = 600.0    # a tier's `engine_restarts` count within this window


def simple_chat_prompt(messages: list[dict]) -> str:
    """A plain chat prompt for checkpoints without a chat template."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


class EngineServer:
    kind = "target"

    def __init__(self, tier: TierModelConfig, engine_class: str = ENGINE_CLASS,
                 stats_period_s: float = 1.0, peers=None):
        import torch

        torch.set_num_threads(tier.threads)
        self.tier = tier
        config = tier.engine_config()
        if tier.runs_engine_process and engine_class == ENGINE_CLASS:
            engine_class = PROCESS_ENGINE_CLASS
        engine_cls = import_object(engine_class) if isinstance(engine_class, str) else engine_class
        # peers: ranks 1..N-1 of a tensor-parallel target (engine.model_runner.Peers), or None.
        started = time.monotonic()
        self.engine = engine_cls(config, peers=peers)
        self.start_s = time.monotonic() - started      # what a restart is expected to take
        self.tokenizer = self.engine.tokenizer
        # An engine in a process of its own restarts in place when that process dies
        # (`_revive`); an in-process engine or a tensor-parallel group is Serve's to replace.
        self._engine_cls = engine_cls
        self.restartable = peers is None and getattr(engine_cls, "restartable", False)
        self._restart: asyncio.Task | None = None
        self._restart_began = 0.0
        self.restarts: list[float] = []                # when each in-place restart began
        self.metrics = ReplicaMetrics(self.kind)
        self._stats_period_s = stats_period_s
        self._exporter: asyncio.Task | None = None
        self._errors = self._engine_errors()
        self.fingerprint = self.replica_fingerprint(tier)
        self.replica_id = _serve_replica_id()     # named in its 503s when the engine is down

    @staticmethod
    def replica_fingerprint(tier: TierModelConfig) -> str:
        """What a seeded request's text depends on besides the request: the served model's
        files (not the draft's: the sampler is exact, drafts change speed only), the sampler
        version, dtype, device type and TP size (numerics). The ingress adds the model name."""
        import hashlib
        import json

        from engine.coupled_sampler import SAMPLER_VERSION
        from models.fingerprint import checkpoint_digest

        material = {"weights": checkpoint_digest(tier.model), "sampler": SAMPLER_VERSION,
                    "dtype": tier.dtype, "device": str(tier.device).split(":")[0],
                    "tp_size": tier.tp_size}
        return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]

    @staticmethod
    def _engine_errors() -> tuple[type, ...]:
        from engine.errors import (EngineDeadError, EngineOverloadedError, PromptTooLongError,
                                   RequestFailedError)

        return PromptTooLongError, EngineOverloadedError, RequestFailedError, EngineDeadError

    # -- Serve hooks --------------------------------------------------------------------------
    @property
    def engine_alive(self) -> bool:
        return getattr(self.engine, "is_alive", True)

    async def check_health(self) -> None:
        """Serve calls this periodically. A dead engine that is restarting in place, or can,
        passes; one that cannot (in-process, or its `engine_restarts` used up) fails, so Serve
        replaces the replica."""
        if not self.engine_alive and not self._revive():
            raise RuntimeError(f"the engine loop stopped: {getattr(self.engine, 'error', None)!r}")

    # -- in-place restart ---------------------------------------------------------------------
    def _revive(self) -> bool:
        """Start restarting a dead engine process if allowed; True while a restart runs."""
        if self._restart is not None and not self._restart.done():
            return True
        if self.engine_alive or not self.restartable:
            return False
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S]
        if len(self.restarts) >= self.tier.engine_restarts:
            return False
        self.restarts.append(now)
        self._restart_began = now
        self._restart = asyncio.get_running_loop().create_task(self._restart_engine())
        return True

    async def _restart_engine(self) -> None:
        """A new engine process on the same config and draft (a swapped one stays swapped): it
        reads the weights again (from the page cache) and its step-cost profile from its cache."""
        old = self.engine
        config = self.tier.engine_config()
        if getattr(old, "draft_path", None):
            config = dataclasses.replace(config, draft=old.draft_path)
        logger.warning("the engine process died (%r); restarting it in place", old.error)
        with contextlib.suppress(Exception):
            old.shutdown()
        try:
            self.engine = await asyncio.to_thread(self._engine_cls, config)
        except Exception:
            logger.exception("restarting the engine failed")
            return
        self.tokenizer = self.engine.tokenizer
        logger.warning("the engine serves again, %.1f s after it was found dead",
                       time.monotonic() - self._restart_began)

    def _down(self, request_id: str) -> TierError:
        """What a request that finds the engine dead is told: retry after the expected
        recovery if the engine is restarting, else when Serve has replaced the replica."""
        if self._revive():
            left = max(1.0, self.start_s - (time.monotonic() - self._restart_began))
            return TierError(503, f"this replica's engine is restarting; retry in {left:.0f} s",
                             type_="server_error", code="replica_restarting", retry_after=left,
                             replica=self.replica_id)
        logger.error("request %s: the engine loop is dead", request_id)
        return TierError(503, "this replica's engine stopped; retry (it is being replaced)",
                         type_="server_error", code="replica_failed", replica=self.replica_id)

    async def ready(self) -> dict:
        self._start_exporter()
        return {"kind": self.kind, "max_model_len": self.engine.max_model_len,
                "stats": await self.record_routing_stats()}

    async def record_routing_stats(self):
        """Serve calls this every `request_routing_stats_period_s`; callers' routers get it.

        The engine's `EngineStats`, as is (`available` is False once the engine loop died, so
        least-loaded routing skips this replica at once until Serve replaces it). Asked in a
        thread: the engine process answers between two steps, and Serve runs this on the
        replica's event loop (with user code on its main loop, `cluster/launch/ray_local.py`,
        a blocking call here would stall every stream of the replica for up to a step)."""
        if not self.engine_alive:
            self._revive()
        return await asyncio.to_thread(self.engine.stats)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this for its autoscaler (a tier with `autoscaling:`): queued + running
        sequences, the share of the KV budget held, and the p95 time to first token of the last
        30 s (0: none), which `router/autoscaling.py` scales the tier on."""
        stats = await asyncio.to_thread(self.engine.stats)
        budget = stats.kv_budget_bytes
        ttft = self.metrics.recent_ttft.percentile(time.monotonic())
        return {"sequences": float(stats.num_running + stats.num_waiting),
                "kv_used": 1.0 - stats.kv_headroom_bytes / budget if budget else 0.0,
                "ttft_p95_s": ttft or 0.0}

    async def stats(self) -> dict:
        """Engine stats and cumulative metrics, for `specserve status` and tests."""
        from dataclasses import asdict

        if self.engine_alive:
            stats, metrics = await asyncio.to_thread(self._snapshot)
        else:       # down (restarting): its last stats, no metrics
            self._revive()
            stats, metrics = await asyncio.to_thread(self.engine.stats), None
        return {"stats": asdict(stats), "metrics": metrics and asdict(metrics),
                "pid": os.getpid(), "engine_pid": getattr(self.engine, "pid", None),
                "restarts": len(self.restarts), "engine_alive": self.engine_alive}

    async def inject_fault(self, kind: str, count: int = 1, after: int = 0) -> None:
        """TEST ONLY: arm a real fault in the engine (refused unless the tier's engine_args set
        fault_injection: true; see engine/faults.py). In a thread: arming a rank's fault waits
        for that rank."""
        await asyncio.to_thread(self.engine.inject_fault, kind, count, after)

    async def draft(self) -> dict:
        """The draft this replica serves (its folder; None: it runs none)."""
        return {"draft": self.engine.draft_path, "pid": os.getpid()}

    async def swap_draft(self, path: str | None = None, rollback: bool = False) -> dict:
        """Swap the colocated draft in place, between two engine steps (requests keep running;
        docs/decisions/0020-aligned-drafts.md says why not a Serve rolling update). The drafts it
        replaced are kept as a stack: `rollback=True` returns to the previous one."""
        history = self.__dict__.setdefault("draft_history", [])
        current = self.engine.draft_path
        if current is None:
            raise TierError(400, "this replica runs no draft to swap")
        if rollback:
            if not history:
                raise TierError(409, "no previous draft to roll back to")
            path = history[-1]
        elif str(Path(path).resolve()) == current:     # already serving it: a no-op
            return {"previous": current, "draft": current, "history": list(history),
                    "pid": os.getpid(), "swapped": False}
        try:
            await asyncio.to_thread(self.engine.swap_draft, path)
        except ValueError as exc:           # ModelLoadError too: vocabulary, tokenizer, KV shape
            raise TierError(400, str(exc)) from None
        history.pop() if rollback else history.append(current)
        logger.info("draft swapped: %s -> %s", current, path)
        return {"previous": current, "draft": self.engine.draft_path,
                "history": list(history), "pid": os.getpid(), "swapped": True}

    def __del__(self):
        try:
            self.engine.shutdown()
        except Exception:
            pass

    # -- requests -----------------------------------------------------------------------------
    def _prompt_token_ids(self, req: GenerateRequest) -> list[int]:
        """The prompt's token ids; a prompt the tokenizer or chat template refuses is the
        caller's 400 (never a replica failure that a client would retry)."""
        try:
            return self._tokenize(req)
        except TierError:
            raise
        except Exception as exc:
            logger.warning("request %s: tokenizing failed: %r", req.request_id, exc)
            what = "messages" if req.messages is not None else "prompt"
            raise TierError(400, f"the {what} could not be tokenized (or the chat template "
                            "refused it)", code="invalid_prompt", param=what) from None

    def _tokenize(self, req: GenerateRequest) -> list[int]:
        tok = self.tokenizer
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
            vocab = len(tok)
            if any(t >= vocab for t in ids):
                raise TierError(400, f"prompt token ids must be below the vocabulary size {vocab}",
                                param="prompt")
        elif req.messages is not None:
            if getattr(tok, "chat_template", None):
                text = tok.apply_chat_template(req.messages, add_generation_prompt=True,
                                               tokenize=False)
                ids = tok(text, add_special_tokens=False)["input_ids"]
            else:
                ids = tok(simple_chat_prompt(req.messages))["input_ids"]
        else:
            ids = tok(req.prompt or "")["input_ids"]
        if not ids:
            raise TierError(400, "the prompt is empty", param="prompt")
        return ids

    def _logprobs(self, req: GenerateRequest, prompt_ids: list[int], out, echo: bool):
        """(this output's logprobs, the prompt's, the prompt's text) for the wire: the engine
        hands the prompt's out once; its text goes on the first chunk, for echo."""
        from engine.logprobs import wire_entries, wire_prompt

        lp = wire_entries(self.tokenizer, out.logprobs) if out.logprobs is not None else None
        prompt_lp = (wire_prompt(self.tokenizer, prompt_ids, out.prompt_logprobs)
                     if out.prompt_logprobs is not None else None)
        prompt_text = None
        if echo:
            prompt_text = req.prompt if req.prompt is not None else self.tokenizer.decode(prompt_ids)
        return lp, prompt_lp, prompt_text

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        from engine.sampling_params import Mode, RequestOptions, SamplingParams

        self._start_exporter()
        try:
            params = SamplingParams(**req.sampling)
            options = RequestOptions(mode=Mode(req.mode), k_max=req.k_max, priority=req.priority)
        except (ValueError, TypeError) as exc:
            raise TierError(400, str(exc)) from None
        prompt_ids = self._prompt_token_ids(req)
        if req.n == 1:     # closed here, so a client that goes away frees the KV at once
            async with contextlib.aclosing(self._choice(req, req.request_id, params, options,
                                                        prompt_ids)) as stream:
                async for chunk in stream:
                    yield chunk
            return

        def sibling(i: int, head: GenerateChunk):
            # seeded: sibling i samples with seed + i (as vLLM); the prompt is scored once, by
            # sibling 0, and its entries go out again on each sibling's first chunk
            p = dataclasses.replace(params, prompt_logprobs=None,
                                    seed=None if params.seed is None else params.seed + i)
            return self._choice(req, f"{req.request_id}/{i}", p, options, prompt_ids,
                                head.prompt_logprobs)

        first = self._choice(req, f"{req.request_id}/0", params, options, prompt_ids)
        async with contextlib.aclosing(merged(first, sibling, req.n)) as stream:
            async for chunk in stream:
                yield chunk

    async def _choice(self, req: GenerateRequest, request_id: str, params, options,
                      prompt_ids: list[int], prompt_lp: list | None = None
                      ) -> AsyncIterator[GenerateChunk]:
        """One engine request's chunks (one choice); `prompt_lp`: the prompt's entries to send
        on the first chunk when another sibling scored them."""
        from engine.async_engine import merge_outputs

        prompt_too_long, overloaded, request_failed, engine_dead = self._errors
        start = last = time.monotonic()
        first, held, echo = True, None, req.echo
        draft = getattr(self.engine, "draft_path", None)   # what ran it, unless swapped meanwhile
        try:
            async for out in self.engine.generate(request_id, prompt_ids, params, options):
                now = time.monotonic()
                if out.token_ids:
                    if first:
                        self.metrics.ttft.observe(now - start, tags={"tier": req.tier})
                        self.metrics.recent_ttft.add(now, now - start)
                    else:
                        self.metrics.itl.observe((now - last) / len(out.token_ids),
                                                 tags={"tier": req.tier})
                    last = now
                # stream_interval: hold the tokens after the first until enough have gathered
                out = merge_outputs(held, out) if held is not None else out
                held = None
                if not first and not out.finished and len(out.token_ids) < self.tier.stream_interval:
                    held = out
                    continue
                lp, own_prompt_lp, prompt_text = self._logprobs(req, prompt_ids, out, echo)
                own_prompt_lp = own_prompt_lp or (prompt_lp if echo else None)
                echo, first = False, first and not out.token_ids
                chunk = self._chunk(out, lp, own_prompt_lp, prompt_text)
                if out.finished and getattr(self.engine, "draft_path", None) == draft:
                    chunk.draft = draft
                yield chunk
        except prompt_too_long as exc:
            raise TierError(400, str(exc), code="context_length_exceeded",
                            param="messages" if req.messages is not None else "prompt") from None
        except overloaded as exc:
            raise TierError(429, str(exc), type_="rate_limit_error", code="overloaded") from None
        except request_failed as exc:      # logged by the engine with the request id
            raise TierError(503, f"{exc} (request {req.request_id})", type_="server_error",
                            code="engine_error") from None
        except engine_dead:
            raise self._down(req.request_id) from None
        except ValueError as exc:      # InvalidParamError names its field
            raise TierError(400, str(exc), param=getattr(exc, "param", None)) from None
        finally:
            # Runs on finish, error and cancellation (client gone): frees the KV at once.
            self.engine.abort(request_id)

    def _chunk(self, out, lp, prompt_lp, prompt_text) -> GenerateChunk:
        return GenerateChunk(text=out.text, token_ids=list(out.token_ids), finished=out.finished,
                             finish_reason=_value(out.finish_reason),
                             num_prompt_tokens=out.num_prompt_tokens,
                             num_output_tokens=out.num_output_tokens, mode=_value(out.mode),
                             acceptance_rate=out.acceptance_rate,
                             mean_acceptance_length=out.mean_acceptance_length,
                             token_acceptance=out.token_acceptance,
                             num_speculative_tokens=out.num_speculative_tokens,
                             num_draft_tokens=out.num_draft_tokens,
                             num_accepted_tokens=out.num_accepted_tokens,
                             num_draft_trials=out.num_draft_trials,
                             reason=out.reason, fingerprint=self.fingerprint, logprobs=lp,
                             prompt_logprobs=prompt_lp, prompt_text=prompt_text)

    # -- metrics ------------------------------------------------------------------------------
    def _start_exporter(self) -> None:
        if self._exporter is None:
            self._exporter = asyncio.get_running_loop().create_task(self._export_loop())

    def _snapshot(self):
        """Stats and cumulative metrics (blocking: each waits for the engine between steps)."""
        return self.engine.stats(), self.engine.metrics()

    async def _export_loop(self) -> None:
        while True:
            try:
                stats, metrics = await asyncio.to_thread(self._snapshot)
                self.metrics.export(stats, metrics)
            except Exception:
                logger.exception("metrics export failed")
            await asyncio.sleep(self._stats_period_s)


def _value(x):
    return getattr(x, "value", x)


def _serve_replica_id() -> str | None:
    """This Serve replica's id (the one callers' request routers know it by); None outside
    Serve."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return None
