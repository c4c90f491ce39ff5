"""The engine in a process of its own (as vLLM's engine core), behind the same asyncio API.

Why: in a Serve replica the step loop would share its process with the replica's event loop,
Ray's core-worker threads and the GIL, and its thread would wait for them within every step
(docs/decisions/0013-engine-process.md). Here the replica keeps the front (tokenizing,
streaming, Serve's hooks) and a child process runs nothing but `LLMEngine.step()` and the
messages between steps.

The core is started as `python -m engine.engine_core FD` (not multiprocessing's spawn, which
re-runs the parent's `__main__`: in a Ray worker that is Ray's worker script) and talks over one
socket pair, pickled tuples each way (`multiprocessing.connection.Connection`); the config is
the first message.

Protocol:
- to the core: ("add", id, prompt, params, options), ("abort", id), ("call", n, method, args)
  for `stats` / `snapshot` / `inject_fault`, ("swap", n, path), ("stop",).
- from the core: ("ready", tokenizer, max_model_len, draft_path, stats), ("out", [outputs]),
  ("rejected", id, error), ("reply", n, ok, value), ("dead", error, traceback).
The core reads its inbox between steps (a new prompt joins the next step; an abort frees the KV
before it) and blocks on it when idle. A reader thread in the replica routes outputs to the
streams' asyncio queues.

Faults: a request that failed inside a step comes back as an output with its error (the engine
serves on). If the core's loop dies or the process is killed (a segfault, the OOM killer), the
reader sees it, every stream gets `EngineDeadError` and `is_alive` turns false, so the replica's
health check fails and Serve replaces it. If the replica dies, the core reads end-of-file on its
inbox and exits: no orphan holds the model's memory.
"""

from __future__ import annotations

import itertools
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from concurrent.futures import Future
from dataclasses import replace

from engine.async_engine import StreamingFront, _Rejected
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.outputs import EngineStats

CALLS = ("stats", "snapshot", "inject_fault")      # what the replica may call in the core
START_TIMEOUT_S = 900.0                              # loading (and profiling) a large model
CALL_TIMEOUT_S = 120.0


def _sendable(exc: BaseException) -> BaseException:
    """The exception itself if it crosses a pipe intact, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _core_main(conn: Connection) -> None:
    """The engine process: build the engine (it sets torch's threads), then step while there
    is work."""
    from engine.llm_engine import LLMEngine

    inbox = outbox = conn
    try:
        config = inbox.recv()
        engine = LLMEngine(config)
    except BaseException as exc:
        outbox.send(("dead", _sendable(exc), traceback.format_exc()))
        return
    draft = engine.draft_model
    outbox.send(("ready", engine.tokenizer, engine.max_model_len,
                 str(draft.path) if draft is not None else None, engine.stats()))
    loaded: queue.Queue = queue.Queue()          # drafts loaded beside the loop, to swap in

    def load(n: int, path: str) -> None:
        try:
            loaded.put((n, engine.load_draft(path), None))
        except BaseException as exc:
            loaded.put((n, None, exc))

    def handle(msg) -> bool:
        kind = msg[0]
        if kind == "add":
            _, request_id, prompt, params, options = msg
            try:
                engine.add_request(request_id, prompt, params, options)
            except Exception as exc:                 # refused: the caller gets it as is
                outbox.send(("rejected", request_id, _sendable(exc)))
        elif kind == "abort":
            engine.abort(msg[1])
        elif kind == "call":
            _, n, method, args = msg
            try:
                if method not in CALLS:
                    raise ValueError(f"the engine process answers {CALLS}, not {method!r}")
                outbox.send(("reply", n, True, getattr(engine, method)(*args)))
            except Exception as exc:
                outbox.send(("reply", n, False, _sendable(exc)))
        elif kind == "swap":
            threading.Thread(target=load, args=msg[1:], daemon=True).start()
        return kind != "stop"

    swapping = 0
    try:
        while True:
            busy = engine.has_unfinished()
            # Idle: block on the inbox (a loading draft is looked at every 50 ms).
            if busy or inbox.poll(None if not swapping else 0.05):
                while inbox.poll(0):
                    msg = inbox.recv()                   # EOFError: the replica is gone
                    swapping += msg[0] == "swap"
                    if not handle(msg):
                        return
            while not loaded.empty():                    # between two steps, as in-process
                n, new, exc = loaded.get()
                swapping -= 1
                if exc is None:
                    engine.swap_draft(new)
                    outbox.send(("reply", n, True, str(engine.draft_model.path)))
                else:
                    outbox.send(("reply", n, False, _sendable(exc)))
            if engine.has_unfinished():
                outputs = engine.step()
                if outputs:
                    outbox.send(("out", outputs))
    except EOFError:
        return
    except BaseException as exc:                 # a bug, or out of memory: fail every stream
        traceback.print_exc()
        try:
            outbox.send(("dead", _sendable(exc), traceback.format_exc()))
        except OSError:
            pass


class ProcessEngine(StreamingFront):
    """`AsyncEngine`'s API with the step loop in a child process (tp_size 1 only: the ranks
    of a tensor-parallel target are Ray actors that rank 0's engine drives in-process)."""

    restartable = True      # its death leaves the replica whole: a new one can start in place

    def __init__(self, config: EngineConfig, peers=None):
        if peers is not None:
            raise ValueError("a tensor-parallel target runs its engine in the replica's process")
        ours, theirs = socket.socketpair()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "engine.engine_core", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=env)
        theirs.close()                  # the core alone holds its end: either side's exit is EOF
        self._conn = Connection(ours.detach())      # both ways: sends locked, one reader
        self._send_lock = threading.Lock()
        self._streams: dict[str, tuple] = {}
        self._calls: dict[int, Future] = {}
        self._numbers = itertools.count()
        self.error: BaseException | None = None
        try:
            self._send(config)          # a core that died at once: its EOF is read below
            msg = self._conn.recv() if self._conn.poll(START_TIMEOUT_S) else None
        except (EOFError, OSError):
            msg = ("dead", EngineDeadError(f"the engine process exited while starting (exit "
                                           f"code {self.process.wait()})"), "")
        if msg is None or msg[0] != "ready":
            self.process.kill()
            if msg is None:
                raise EngineDeadError(f"the engine process did not start in {START_TIMEOUT_S:.0f} s")
            raise msg[1]                 # the engine's own error (a bad checkpoint, memory)
        # The first stats too: a core dead before anyone asked still reports its budget.
        self._last_stats: EngineStats
        _, self.tokenizer, self.max_model_len, self.draft_path, self._last_stats = msg
        self._reader = threading.Thread(target=self._read, name="specserve-engine-reader",
                                        daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def is_alive(self) -> bool:
        return self.error is None and self.process.poll() is None

    # -- to the core --------------------------------------------------------------------------
    def _send(self, msg) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _submit(self, request_id, prompt, params, options, stream) -> None:
        self._streams[request_id] = stream
        try:
            self._send(("add", request_id, prompt, params, options))
        except OSError:
            pass
        if self.error is not None:      # died meanwhile: the reader may have missed this stream
            self._streams.pop(request_id, None)
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, self.error)

    def abort(self, request_id: str) -> None:
        """Abort (the core frees its KV before its next step); never blocks on a step."""
        self._streams.pop(request_id, None)
        try:
            self._send(("abort", request_id))
        except OSError:
            pass

    def _call(self, kind: str, *args, timeout: float = CALL_TIMEOUT_S):
        if not self.is_alive:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        n, future = next(self._numbers), Future()
        self._calls[n] = future
        try:
            self._send((kind, n, *args))
        except OSError:
            pass
        if self.error is not None:      # died meanwhile: the reader may have missed this call
            self._calls.pop(n, None)
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        return future.result(timeout)

    def stats(self) -> EngineStats:
        if not self.is_alive:
            return replace(self._last_stats, available=False, num_running=0, num_waiting=0,
                           kv_used_target_bytes=0, kv_used_draft_bytes=0)
        stats = self._call("call", "stats", ())
        self._last_stats = stats
        return replace(stats, available=self.is_alive)

    def metrics(self):
        return self._call("call", "snapshot", ())

    def inject_fault(self, kind: str, count: int = 1, after: int = 0) -> None:
        """TEST ONLY: see `LLMEngine.inject_fault`."""
        self._call("call", "inject_fault", (kind, count, after))

    def swap_draft(self, path: str) -> None:
        """Load a new draft in the core beside the running one (steps go on), then swap it in
        between two steps."""
        self.draft_path = self._call("swap", path, timeout=START_TIMEOUT_S)

    def shutdown(self) -> None:
        try:
            self._send(("stop",))
        except OSError:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)

    # -- from the core ------------------------------------------------------------------------
    def _read(self) -> None:
        error: BaseException | None = None
        try:
            while True:
                msg = self._conn.recv()
                kind = msg[0]
                if kind == "out":
                    self._route(msg[1])
                elif kind == "rejected":
                    stream = self._streams.pop(msg[1], None)
                    if stream is not None:
                        _deliver(stream[0], stream[1].put_nowait, _Rejected(msg[2]))
                elif kind == "reply":
                    _, n, ok, value = msg
                    future = self._calls.pop(n, None)
                    if future is not None:
                        future.set_result(value) if ok else future.set_exception(value)
                elif kind == "dead":
                    error = msg[1]
                    break
        except (EOFError, OSError) as exc:
            try:
                code = self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            error = EngineDeadError(f"the engine process exited ({exc!r}, exit code {code})")
        self.error = error
        dead = EngineDeadError(f"the engine stopped: {error!r}")
        streams, self._streams = list(self._streams.values()), {}
        for loop, q in streams:
            _deliver(loop, q.put_nowait, error)
        calls, self._calls = list(self._calls.values()), {}
        for future in calls:
            future.set_exception(dead)

    def _route(self, outputs) -> None:
        by_loop: dict = {}
        for out in outputs:
            stream = (self._streams.pop(out.request_id, None) if out.finished
                      else self._streams.get(out.request_id))
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], out))
        for loop, items in by_loop.items():          # one wake-up of each event loop a step
            _deliver(loop, _put_all, items)


def _deliver(loop, fn, *args) -> None:
    """Run `fn` on a stream's event loop; a loop closed meanwhile (its caller gone) is skipped,
    never allowed to stop the reader."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _put_all(items) -> None:
    for q, out in items:
        q.put_nowait(out)


__all__ = ["ProcessEngine", "CALLS"]

if __name__ == "__main__":
    _core_main(Connection(int(sys.argv[1])))
