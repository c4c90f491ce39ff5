"""A prompt the tokenizer or the chat template refuses is the caller's 400, not a replica failure
(a 503 `replica_failed` with Retry-After would have clients retry a bad request, a lone
surrogate say, forever). No Ray: the replica class alone."""

from __future__ import annotations

import asyncio

import pytest

from deployments.small import SmallServer
from router.config import TierModelConfig
from router.wire import GenerateRequest, TierError


@pytest.fixture(scope="module")
def small(tiny_family):
    cfg = TierModelConfig(model=str(tiny_family["small"]), kv_budget_bytes=4 << 20)
    server = SmallServer(cfg)
    yield server
    server.engine.shutdown()


def _generate(server, **prompt):
    req = GenerateRequest("r", "small", "baseline", 0, {"max_tokens": 2, "temperature": 0},
                          **prompt)

    async def run():
        return [chunk async for chunk in server.generate(req)]
    return asyncio.run(run())


@pytest.mark.parametrize("prompt", [
    {"prompt": "a\ud800b"},
    {"messages": [{"role": "user", "content": "\udfff"}]},
])
def test_untokenizable_prompt_is_400(small, prompt):
    with pytest.raises(TierError) as err:
        _generate(small, **prompt)
    assert err.value.status == 400 and err.value.code == "invalid_prompt"
    assert err.value.param == ("messages" if "messages" in prompt else "prompt")
    assert _generate(small, prompt="def add(a, b):")[-1].finished      # still serving


def test_chat_template_failure_is_400(small):
    saved = small.tokenizer.chat_template
    small.tokenizer.chat_template = "{{ raise_exception('only user messages') }}"
    try:
        with pytest.raises(TierError) as err:
            _generate(small, messages=[{"role": "system", "content": "hi"}])
        assert err.value.status == 400 and err.value.param == "messages"
        assert "only user messages" not in err.value.message       # no exception text
    finally:
        small.tokenizer.chat_template = saved
