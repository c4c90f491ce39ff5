"""The engine behind an asyncio API: a step loop on its own thread, results streamed back.

Owns: the thread that calls `LLMEngine.step()` while there is work, the per-request asyncio
queues results are pushed to, and cleanup when a caller goes away (an abandoned or cancelled
`generate` aborts its request, freeing its KV at once). Torch releases the GIL inside its
kernels, so the event loop stays responsive while a step runs.

Faults: a request that failed inside a step gets `RequestFailedError` on its stream and the loop
goes on; if the loop itself dies, every stream gets `EngineDeadError` and `is_alive` turns false
(the replica's health check reads it, so Serve replaces the replica).
"""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections.abc import AsyncIterator
from dataclasses import replace

from engine.config import EngineConfig
from engine.errors import EngineDeadError, RequestFailedError
from engine.llm_engine import LLMEngine
from engine.metrics import MetricsSnapshot
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import RequestOptions, SamplingParams


class AsyncEngine:
    def __init__(self, config: EngineConfig, peers=None, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config, peers)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self._lock = threading.Lock()          # guards every touch of self.engine
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="specserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       options: RequestOptions | None = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs; raises the engine's validation errors before the first one."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self.engine.add_request(request_id, prompt_token_ids, params, options)
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise EngineDeadError(f"the engine stopped: {out!r}") from out
                finished = out.finished
                if out.error is not None:      # this request failed; the engine serves on
                    raise RequestFailedError(out.error)
                yield out
        finally:
            if not finished:                   # cancelled, disconnected or abandoned
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

    def inject_fault(self, kind: str, count: int = 1, after: int = 0) -> None:
        """TEST ONLY: see `LLMEngine.inject_fault`."""
        with self._lock:
            self.engine.inject_fault(kind, count, after)

    def stats(self) -> EngineStats:
        with self._lock:
            return replace(self.engine.stats(), available=self.is_alive)

    def metrics(self) -> MetricsSnapshot:
        with self._lock:
            return self.engine.snapshot()

    def swap_draft(self, path: str) -> None:
        """Load a new draft beside the running one, then swap it in between two steps."""
        loaded = self.engine.load_draft(path)       # seconds: outside the lock, steps go on
        with self._lock:
            self.engine.swap_draft(loaded)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        try:
            while not self._stop:
                with self._lock:
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
        except BaseException as exc:           # a bug, or out of memory: fail every stream loudly
            traceback.print_exc()
            self.error = exc
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for loop, queue in streams:
                loop.call_soon_threadsafe(queue.put_nowait, exc)
