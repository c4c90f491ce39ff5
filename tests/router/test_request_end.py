"""The one end of a request at the ingress (`router/lifecycle.py`), through `Ingress._serve`.

Each outcome (ok, client_gone, error), streamed and not, must leave exactly one ledger record
with the right status and priced usage, count `specserve_requests` once with its status,
count the revenue once, cancel the tier stream and give the admission ticket back. The ingress,
its accounting, ledger (SQLite), admission and observer are the real ones; only Ray Serve's
deployment handle is stood in for, by `TierHandle`, which streams scripted replica chunks.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from router.billing import RunCounts, price_micro_usd
from router.config import AppConfig
from router.ingress import Ingress
from router.ledger import read_records
from router.wire import GenerateChunk


def _chunk(n: int, finished: bool = False) -> GenerateChunk:
    """The replica's n-th cumulative chunk of a 3-token prompt."""
    return GenerateChunk(text=f"t{n}", token_ids=[n], finished=finished,
                         finish_reason="length" if finished else None, num_prompt_tokens=3,
                         num_output_tokens=n, mode="baseline")


class TierStream:
    """What `handle.options(stream=True).generate.remote(...)` returns: chunks, then `end`:
    "finish" (the last chunk is finished), "hang" (waits until cancelled) or "fail"."""

    def __init__(self, n: int, end: str):
        self.chunks = [_chunk(i + 1, finished=end == "finish" and i == n - 1) for i in range(n)]
        self.end = end
        self.cancelled = False
        self.hanging = asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self) -> GenerateChunk:
        if self.chunks:
            return self.chunks.pop(0)
        if self.end == "fail":
            raise RuntimeError("the replica died")
        if self.end == "hang":
            self.hanging.set()
            await asyncio.Event().wait()
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class TierHandle:
    """Stands in for Ray Serve's `DeploymentHandle` of the target tier."""

    def __init__(self, n: int, end: str):
        self.stream = None
        self.n, self.end = n, end
        self.deployment_id = SimpleNamespace(app_name="test", name="Target")
        self.generate = SimpleNamespace(remote=self._generate)
        self.ready = SimpleNamespace(remote=lambda: asyncio.get_running_loop().create_future())

    def options(self, stream: bool):
        return self

    def _generate(self, gen_req):
        self.stream = TierStream(self.n, self.end)
        return self.stream


def _request(body: dict, path: str = "/standard/v1/completions") -> Request:
    raw = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())]}

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request(scope, receive)


def _ingress(tmp_path, handle: TierHandle, monkeypatch) -> tuple[Ingress, list, list]:
    cfg = AppConfig.model_validate({
        "target": {"model": "/m"}, "auth": {"require_key": False, "default_plan": "standard"},
        "ledger": {"url": f"sqlite:///{tmp_path}/ledger.db", "drain_period_s": 3600}})
    ingress = Ingress(cfg, handle)
    ended, charged = [], []
    monkeypatch.setattr(ingress.metrics.requests, "inc",
                        lambda value=1.0, tags=None: ended.append(tags["status"]))
    monkeypatch.setattr(ingress.metrics.price, "inc",
                        lambda value=1.0, tags=None: charged.append(round(value * 1e6)))
    return ingress, ended, charged


def _records(ingress: Ingress) -> list:
    ingress.accounts.ledger.drain_once()
    return read_records(ingress.accounts.db)


async def _stream_body(response, disconnect_when: asyncio.Event | None = None) -> list[str]:
    """Run a StreamingResponse as Starlette does; the client disconnects on `disconnect_when`."""
    sent = []

    async def send(message):
        if message["type"] == "http.response.body" and message["body"]:
            sent.append(message["body"].decode())

    async def receive():
        await (disconnect_when.wait() if disconnect_when else asyncio.Event().wait())
        return {"type": "http.disconnect"}

    await response({"type": "http"}, receive, send)
    return sent


def _assert_one_record(ingress, handle, ended, charged, status, http_status, tokens):
    records = _records(ingress)
    assert len(records) == 1, records
    rec = records[0]
    assert (rec.status, rec.http_status, rec.completion_tokens) == (status, http_status, tokens)
    price = price_micro_usd(ingress.cfg.prices, RunCounts("baseline", 3, tokens))
    assert rec.price_micro_usd == price > 0
    assert charged == [price]                       # revenue counted once, as the ledger
    assert ended == [str(http_status if status != "client_gone" else 499)]
    assert handle.stream.cancelled                  # the replica aborts what is left
    assert ingress.admission.in_flight == 0         # the ticket is back
    return rec


@pytest.mark.parametrize("stream", [False, True])
def test_ok(tmp_path, monkeypatch, stream):
    handle = TierHandle(3, "finish")
    ingress, ended, charged = _ingress(tmp_path, handle, monkeypatch)

    async def run():
        response = await ingress._serve(_request(
            {"model": "specserve", "prompt": "abc", "max_tokens": 3, "stream": stream}), chat=False)
        if not stream:
            return json.loads(response.body)["usage"]
        events = await _stream_body(response)
        assert events[-1] == "data: [DONE]\n\n"
        return json.loads(events[-2][len("data: "):])["usage"]

    try:
        usage = asyncio.run(run())
        rec = _assert_one_record(ingress, handle, ended, charged, "ok", 200, 3)
        assert usage["price_micro_usd"] == rec.price_micro_usd and usage["tier"] == "baseline"
    finally:
        ingress.accounts.close()


@pytest.mark.parametrize("stream", [False, True])
def test_client_gone(tmp_path, monkeypatch, stream):
    handle = TierHandle(2, "hang")
    ingress, ended, charged = _ingress(tmp_path, handle, monkeypatch)

    async def run():
        request = _request({"model": "specserve", "prompt": "abc", "max_tokens": 8,
                            "stream": stream})
        if stream:
            response = await ingress._serve(request, chat=False)
            gone = asyncio.Event()
            waiter = asyncio.create_task(_hanging(handle, gone))
            events = await _stream_body(response, disconnect_when=gone)
            await waiter
            assert events and "[DONE]" not in events[-1]
            return
        task = asyncio.create_task(ingress._serve(request, chat=False))
        await _hanging(handle)
        task.cancel()                               # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(run())
        rec = _assert_one_record(ingress, handle, ended, charged, "client_gone", 499, 2)
        assert rec.error is None
    finally:
        ingress.accounts.close()


async def _hanging(handle: TierHandle, then: asyncio.Event | None = None) -> None:
    """Wait until the tier stream has sent its chunks and waits for more."""
    while handle.stream is None:
        await asyncio.sleep(0.01)
    await handle.stream.hanging.wait()
    if then is not None:
        then.set()


@pytest.mark.parametrize("stream", [False, True])
def test_error(tmp_path, monkeypatch, stream):
    handle = TierHandle(2, "fail")
    ingress, ended, charged = _ingress(tmp_path, handle, monkeypatch)

    async def run():
        response = await ingress._serve(_request(
            {"model": "specserve", "prompt": "abc", "max_tokens": 8, "stream": stream}), chat=False)
        if not stream:
            assert response.status_code == 503
            return json.loads(response.body)["error"]
        events = await _stream_body(response)
        assert events[-1] == "data: [DONE]\n\n"
        return json.loads(events[-2][len("data: "):])["error"]

    try:
        error = asyncio.run(run())
        assert error["code"] == "replica_failed"
        rec = _assert_one_record(ingress, handle, ended, charged, "error", 503, 2)
        assert "replica_failed" not in rec.error and "tier failed" in rec.error
    finally:
        ingress.accounts.close()


def test_a_refused_request_ends_once_without_a_record(tmp_path, monkeypatch):
    """An error before admission for billing (here a 400) has no ledger record, but it is
    counted and gives its ticket back."""
    handle = TierHandle(1, "finish")
    ingress, ended, charged = _ingress(tmp_path, handle, monkeypatch)

    async def run():
        return await ingress._serve(_request({"model": "specserve", "prompt": "abc",
                                              "max_tokens": 0}), chat=False)

    try:
        response = asyncio.run(run())
        assert response.status_code == 400
        assert _records(ingress) == [] and charged == [] and handle.stream is None
        assert ended == ["400"] and ingress.admission.in_flight == 0
    finally:
        ingress.accounts.close()


def test_client_gone_before_the_stream_ran(tmp_path, monkeypatch):
    """A streamed response dropped before its first event (the client left while it was being
    sent) ends when it is collected: billed for the chunk the tier had sent."""
    import gc

    handle = TierHandle(1, "hang")
    ingress, ended, charged = _ingress(tmp_path, handle, monkeypatch)

    async def run():
        response = await ingress._serve(_request(
            {"model": "specserve", "prompt": "abc", "max_tokens": 8, "stream": True}), chat=False)
        assert ingress.admission.in_flight == 1 and ended == []
        del response
        gc.collect()

    try:
        asyncio.run(run())
        _assert_one_record(ingress, handle, ended, charged, "client_gone", 499, 1)
    finally:
        ingress.accounts.close()
