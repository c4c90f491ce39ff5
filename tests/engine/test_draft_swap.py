"""A new draft swapped in between steps: running requests finish with the target's exact output,
later steps draft with the new weights, and a draft that cannot share the pool is refused."""

import pytest

from engine.sampling_params import RequestOptions, SamplingParams
from models.loader import ModelLoadError, load_model

PROMPT = [5, 7, 9, 11, 13]


@pytest.fixture(scope="module")
def better_draft(tiny_family, tmp_path_factory):
    from tiny_models import make_llama

    folder = tmp_path_factory.mktemp("better-draft")
    target = load_model(tiny_family["target"])
    make_llama(folder, target.tokenizer, seed=3, base=target.model, noise=0.0)   # = the target
    return folder


def _greedy(engine, rid, mode, n=24):
    engine.add_request(rid, PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                       RequestOptions(mode, k_max=4))


def test_swap_mid_generation_is_lossless_and_uses_the_new_draft(make_engine, better_draft):
    engine = make_engine(adaptive_k=False)
    _greedy(engine, "base", "baseline")
    _greedy(engine, "spec", "speculative")
    out = {"base": [], "spec": []}
    for _ in range(3):
        for o in engine.step():
            out[o.request_id] += o.token_ids
    before = engine.metrics.data.num_accepted_tokens, engine.metrics.data.num_draft_tokens
    engine.swap_draft(engine.load_draft(str(better_draft)))
    assert engine.draft_swaps == 1 and engine.draft_model.path == better_draft.resolve()
    assert all(not s.draft_blocks and s.draft_computed == 0 for s in engine.seqs.values())
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.token_ids
    assert out["spec"] == out["base"] and len(out["spec"]) == 24
    accepted = engine.metrics.data.num_accepted_tokens - before[0]
    drafted = engine.metrics.data.num_draft_tokens - before[1]
    assert drafted and accepted == drafted          # the new draft is the target: all accepted


def test_swap_refuses_another_kv_shape_or_vocabulary(make_engine, tiny_family, tmp_path):
    from tiny_models import make_llama, make_tokenizer

    engine = make_engine()
    with pytest.raises(ValueError, match="KV shape"):
        engine.load_draft(str(tiny_family["small"]))
    tok = make_tokenizer(tmp_path, vocab_size=300)
    make_llama(tmp_path, tok)
    with pytest.raises(ModelLoadError, match="vocabulary"):
        engine.load_draft(str(tmp_path))
    assert engine.draft_swaps == 0
