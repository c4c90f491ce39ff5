"""The engine behind an asyncio API: a step loop on its own thread, results streamed back.

Owns: the thread that calls `LLMEngine.step()` while there is work, the per-request asyncio
queues results are pushed to, and cleanup when a caller goes away (an abandoned or cancelled
`generate` aborts its request, freeing its KV at once). Torch releases the GIL inside its
kernels, so the event loop stays responsive while a step runs.

Faults: a request that failed inside a step gets `RequestFailedError` on its stream and the loop
goes on; if the loop itself dies, every stream gets `EngineDeadError` and `is_alive` turns false
(the replica's health check reads it, so Serve replaces the replica).

New requests and aborts never wait for a step: they go into an inbox that the step thread (or
any other holder of the engine lock) drains before it touches the engine, so the event loop is
never blocked behind a forward pass, and a new prompt joins the very next step. (Were they to
take the engine lock themselves, the step thread would re-take it right after releasing it, so
under load an `add_request` could wait several steps with the whole event loop blocked, and
time to first token would grow with the number of streams.) Stats readers take the lock, and
the step thread yields it to them between steps.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import replace

from engine.config import EngineConfig
from engine.errors import EngineDeadError, InvalidParamError, RequestFailedError
from engine.llm_engine import LLMEngine
from engine.metrics import MetricsSnapshot
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import RequestOptions, SamplingParams


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: the deltas joined, the rest the later's."""
    logprobs = (None if first.logprobs is None and then.logprobs is None
                else (first.logprobs or []) + (then.logprobs or []))
    return replace(then, text=first.text + then.text, token_ids=first.token_ids + then.token_ids,
                   reason=then.reason or first.reason, logprobs=logprobs,
                   prompt_logprobs=first.prompt_logprobs or then.prompt_logprobs)


class _Rejected:
    """A request the engine refused (validation, overload): raised to its caller as is."""

    def __init__(self, error: BaseException):
        self.error = error


class StreamingFront:
    """What the replica sees of an engine, wherever its step loop runs: `generate` streams a
    request's outputs from an asyncio queue that the step loop's side fills (`_submit` hands
    the request over; `abort` takes it back)."""

    error: BaseException | None = None

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    def _submit(self, request_id: str, prompt: list[int], params: SamplingParams,
                options: RequestOptions | None, stream: tuple) -> None:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       options: RequestOptions | None = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs; raises the engine's validation errors before the first one."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._submit(request_id, list(prompt_token_ids), params, options,
                     (asyncio.get_running_loop(), queue))
        finished, pending = False, None
        try:
            while not finished:
                out = pending if pending is not None else await queue.get()
                pending = None
                if isinstance(out, _Rejected):
                    finished = True                # never added: nothing to abort
                    raise out.error
                if isinstance(out, BaseException):
                    raise EngineDeadError(f"the engine stopped: {out!r}") from out
                if out.error is not None:      # this request failed; the engine serves on
                    finished = out.finished
                    if out.error_param is not None:
                        raise InvalidParamError(out.error, out.error_param)
                    raise RequestFailedError(out.error)
                # Outputs that piled up while the caller was busy go out as one: under load
                # each message up the serving path (Ray, ingress, proxy) costs CPU the engine
                # shares; at low load nothing waits and every step's tokens go at once.
                while not out.finished and not queue.empty():
                    more = queue.get_nowait()
                    if not isinstance(more, RequestOutput) or more.error is not None:
                        pending = more
                        break
                    out = merge_outputs(out, more)
                finished = out.finished
                yield out
        finally:
            if not finished:                   # cancelled, disconnected or abandoned
                self.abort(request_id)


class AsyncEngine(StreamingFront):
    def __init__(self, config: EngineConfig, peers=None, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config, peers)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self._lock = threading.Lock()          # guards every touch of self.engine
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._inbox: deque = deque()         # ("add", ...) / ("abort", id): appended by any thread
        self._lock_waiters = 0                 # threads waiting for the lock (the loop yields to them)
        self._waiters_lock = threading.Lock()  # `+= 1` from several threads is not atomic
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="specserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def draft_path(self) -> str | None:
        draft = self.engine.draft_model
        return str(draft.path) if draft is not None else None

    def _submit(self, request_id, prompt, params, options, stream) -> None:
        self._inbox.append(("add", request_id, prompt, params, options, stream))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Abort (its KV is freed before the engine's next step or stats read); never blocks."""
        self._inbox.append(("abort", request_id))
        self._wake.set()

    def _locked(self):
        return _FairLock(self)

    def _drain(self) -> None:
        """Apply queued adds and aborts. Caller holds the lock."""
        while self._inbox:
            op = self._inbox.popleft()
            if op[0] == "abort":
                self._streams.pop(op[1], None)
                self.engine.abort(op[1])
                continue
            _, request_id, prompt, params, options, stream = op
            try:
                self.engine.add_request(request_id, prompt, params, options)
            except Exception as exc:                   # refused: the caller gets it as is
                loop, queue = stream
                loop.call_soon_threadsafe(queue.put_nowait, _Rejected(exc))
                continue
            self._streams[request_id] = stream

    def inject_fault(self, kind: str, count: int = 1, after: int = 0) -> None:
        """TEST ONLY: see `LLMEngine.inject_fault`."""
        with self._locked():
            self.engine.inject_fault(kind, count, after)

    def stats(self) -> EngineStats:
        with self._locked():
            return replace(self.engine.stats(), available=self.is_alive)

    def metrics(self) -> MetricsSnapshot:
        with self._locked():
            return self.engine.snapshot()

    def swap_draft(self, path: str) -> None:
        """Load a new draft beside the running one, then swap it in between two steps."""
        loaded = self.engine.load_draft(path)       # seconds: outside the lock, steps go on
        with self._locked():
            self.engine.swap_draft(loaded)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        try:
            while not self._stop:
                if self._lock_waiters:         # a stats reader is waiting: let it in first
                    time.sleep(0.0002)
                with self._lock:
                    self._drain()
                    busy = self.engine.has_unfinished()
                    outputs = self.engine.step() if busy else []
                    targets = [(self._streams.get(o.request_id), o) for o in outputs]
                    for o in outputs:
                        if o.finished:
                            self._streams.pop(o.request_id, None)
                for stream, out in targets:
                    if stream is not None:
                        loop, queue = stream
                        loop.call_soon_threadsafe(queue.put_nowait, out)
                if not busy:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    if self._inbox:
                        self._wake.set()
        except BaseException as exc:           # a bug, or out of memory: fail every stream loudly
            traceback.print_exc()
            self.error = exc
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
                streams += [op[-1] for op in self._inbox if op[0] == "add"]   # never added
                self._inbox.clear()
            for loop, queue in streams:
                loop.call_soon_threadsafe(queue.put_nowait, exc)


class _FairLock:
    """The engine lock for callers other than the step thread: counted while they wait, so the
    step thread steps aside between two steps; queued adds and aborts are applied first."""

    def __init__(self, owner: AsyncEngine):
        self.owner = owner

    def __enter__(self):
        o = self.owner
        with o._waiters_lock:
            o._lock_waiters += 1
        try:
            o._lock.acquire()
        finally:
            with o._waiters_lock:
                o._lock_waiters -= 1
        try:
            o._drain()
        except BaseException:
            o._lock.release()
            raise
        return self

    def __exit__(self, *exc):
        self.owner._lock.release()
