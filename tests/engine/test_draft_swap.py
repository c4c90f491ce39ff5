"""A new draft swapped in between steps: running requests finish with the target's exact output,
later steps draft with the new weights and the acceptance estimate starts over, and a draft that
cannot share the pool is refused."""

import pytest

from engine.acceptance import ENGINE_DECAY, ENGINE_PRIOR_TRIALS, AcceptanceEstimate
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


def test_swap_restarts_the_acceptance_estimate_from_the_prior(make_engine, better_draft):
    """The old draft's acceptance says nothing about the new one's: after a swap the engine's
    live estimate (adaptive k, what the router sees) is the prior again, and the next steps
    move it from there alone.

    Breaks when `swap_draft` keeps the old draft's counts (no `self.acceptance.reset()`): the
    estimate after the swap is the old draft's, and the new draft's steps move it from there."""
    engine = make_engine(adaptive_k=False, prior_acceptance=0.2)   # far from the draft's
    prior = engine.config.prior_acceptance
    _greedy(engine, "spec", "speculative", n=100)
    for _ in range(10):
        engine.step()
    moved = engine.acceptance
    assert moved.value > prior + 0.1 and moved.trials != ENGINE_PRIOR_TRIALS
    engine.swap_draft(engine.load_draft(str(better_draft)))
    assert engine.global_acceptance == pytest.approx(prior)
    assert (engine.acceptance.accepted, engine.acceptance.trials) == pytest.approx(
        (prior * ENGINE_PRIOR_TRIALS, ENGINE_PRIOR_TRIALS))
    replay = AcceptanceEstimate(prior, ENGINE_PRIOR_TRIALS, ENGINE_DECAY)
    seq = engine.seqs["spec"]
    drafted, accepted = seq.num_draft_tokens, seq.num_accepted
    for _ in range(3):
        (o,) = engine.step()
        k, a = o.num_draft_tokens - drafted, o.num_accepted_tokens - accepted
        assert k and a == k                   # the new draft is the target: all accepted
        drafted, accepted = o.num_draft_tokens, o.num_accepted_tokens
        replay.observe(a, a)
    assert engine.global_acceptance == pytest.approx(replay.value, rel=1e-12)
