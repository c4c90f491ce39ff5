"""A prompt's KV is the same bits however the scheduler cut it into chunks.

Where the token budget cuts a prompt depends on what else runs in the step (decode tokens,
verify tokens, other prompts), so it depends on the load. If the prompt's KV depended on the cut,
a request's output would depend on the load at near-ties: greedy speculative output would not
equal plain decoding, and seeded requests would not be reproducible under load
(docs/decisions/0007-prefill-alignment.md).
"""

import random

import pytest
import torch

from conftest import run_all
from engine.sampling_params import RequestOptions, SamplingParams

PROMPT = [(7 * i + 3) % 97 + 5 for i in range(53)]
OTHERS = [[(5 * i + j) % 89 + 4 for i in range(11 + 3 * j)] for j in range(5)]


def _kv(engine, seq) -> list[torch.Tensor]:
    """The target's K and V of seq's computed tokens, every layer."""
    pool = engine.pool
    out = []
    for k_cache, v_cache in pool.layers(pool.target):
        for cache in (k_cache, v_cache):
            rows = cache.index_select(0, torch.tensor(seq.blocks)).flatten(1, 2).flatten(0, 1)
            out.append(rows[:seq.num_computed].clone())
    return out


def _prefilled(engine, request_id, arrivals):
    """Step until request_id's prompt is in the cache; its KV, and the chunk lengths it was fed."""
    arrivals, step, chunks = dict(arrivals), 0, []
    while True:
        for args in arrivals.pop(step, []):
            engine.add_request(*args)
        step += 1
        seq = next((s for s in engine.scheduler.running if s.request_id == request_id), None)
        before = seq.num_computed if seq else 0
        engine.step()
        seq = next((s for s in engine.scheduler.running if s.request_id == request_id), None)
        if seq is not None and seq.num_computed > before:
            chunks.append(seq.num_computed - before)
            if seq.num_computed >= len(PROMPT):
                return _kv(engine, seq), chunks
        assert step < 500


def _params():
    return SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_kv_does_not_depend_on_where_it_was_cut(make_engine, dtype):
    alone = make_engine(draft=False, dtype=dtype, max_num_batched_tokens=512, prefill_align=16)
    expect, chunks = _prefilled(alone, "p", {0: [("p", PROMPT, _params(), RequestOptions())]})
    assert chunks == [len(PROMPT)]
    run_all(alone)
    seen = set()
    rng = random.Random(0)
    for budget in (16, 17, 20, 24, 30, 33, 40, 52):
        engine = make_engine(dtype=dtype, max_num_batched_tokens=budget, prior_acceptance=0.95,
                             prefill_align=16)
        # Other requests, some speculating, arrive first, so that the step that starts the
        # prompt also carries their decode, verify and prompt tokens.
        arrivals = {}
        for j, other in enumerate(OTHERS):
            mode = ("speculative", "baseline")[j % 2]
            arrivals.setdefault(rng.randrange(3), []).append(
                (f"o{j}", other, _params(), RequestOptions(mode=mode, k_max=1 + j)))
        arrivals.setdefault(rng.randrange(2, 6), []).append(
            ("p", PROMPT, _params(), RequestOptions()))
        kv, chunks = _prefilled(engine, "p", arrivals)
        seen.add(tuple(chunks))
        for layer, (got, want) in enumerate(zip(kv, expect)):
            assert torch.equal(got, want), (budget, chunks, layer)
        run_all(engine)
    assert len(seen) >= 4, seen           # the prompt was cut in several different ways


@pytest.mark.parametrize("align", [0, -16, 2.5, "16", True, 1024])
def test_a_bad_prefill_align_is_refused_at_config(tiny_family, align):
    """An align that is no integer in [1, max_num_batched_tokens] would cut pieces of no size
    (or slice with floats mid-step): refused where the config is built, naming the field."""
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="prefill_align"):
        EngineConfig(str(tiny_family["target"]), None, max_num_batched_tokens=512,
                     prefill_align=align)
    assert EngineConfig(str(tiny_family["target"]), None, max_num_batched_tokens=40,
                        profile=False).prefill_align == 10
