"""The asyncio wrapper: streaming, finish reasons, and a cancelled stream freeing its KV at once."""

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import PromptTooLongError
from engine.sampling_params import FinishReason, RequestOptions, SamplingParams


@pytest.fixture(scope="module")
def aengine(tiny_family):
    e = AsyncEngine(EngineConfig(str(tiny_family["target"]), str(tiny_family["draft"]),
                                 kv_budget_bytes=4 << 20, profile=False, num_threads=1,
                                 max_model_len=256))
    yield e
    e.shutdown()


def test_streams_and_finishes(aengine):
    async def go():
        chunks = []
        async for out in aengine.generate("s1", [5, 7, 9], SamplingParams(temperature=0, max_tokens=9,
                                          ignore_eos=True), RequestOptions("speculative", k_max=3)):
            chunks.append(out)
        return chunks
    chunks = asyncio.run(go())
    assert chunks[-1].finished and chunks[-1].finish_reason == FinishReason.LENGTH
    assert sum(len(c.token_ids) for c in chunks) == 9
    assert all(not c.finished for c in chunks[:-1])


def test_cancelled_stream_frees_kv(aengine):
    async def go():
        gen = aengine.generate("s2", [5] * 50, SamplingParams(temperature=0, max_tokens=200,
                               ignore_eos=True), RequestOptions("speculative", k_max=3))
        first = await gen.__anext__()
        assert aengine.stats().kv_used_target_bytes > 0
        await gen.aclose()                       # the client went away
        return first
    asyncio.run(go())
    stats = aengine.stats()
    assert stats.kv_used_target_bytes == 0 and stats.kv_used_draft_bytes == 0
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_errors_come_before_the_first_output(aengine):
    async def go():
        async for _ in aengine.generate("s3", [5] * 300, SamplingParams()):
            pass
    with pytest.raises(PromptTooLongError, match="at most 255"):
        asyncio.run(go())
    assert aengine.is_alive


def test_a_failed_request_gets_an_error_and_the_engine_serves_on(aengine):
    from engine.errors import RequestFailedError

    params = SamplingParams(temperature=1.0, max_tokens=4)
    object.__setattr__(params, "top_k", 9223372036854775808)   # forced past validation

    async def collect(rid, p):
        return [o async for o in aengine.generate(rid, [5, 7, 9], p)]

    with pytest.raises(RequestFailedError, match="engine failed"):
        asyncio.run(collect("bad", params))
    assert aengine.is_alive
    chunks = asyncio.run(collect("good", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
    assert chunks[-1].finished and sum(len(c.token_ids) for c in chunks) == 5
    stats = aengine.stats()
    assert stats.kv_used_target_bytes == 0 and stats.num_running == 0
