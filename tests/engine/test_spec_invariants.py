"""Guards against bugs that the statistical and greedy tests alone would let through:

- reusing the first draft round's q for later positions (needs steps with k >= 2);
- drawing the accept decisions from the global RNG instead of the request's generator;
- dropping speculation without freeing the draft's KV;
- never trimming the blocks that rejected drafts were given;
- taking the draft's KV to hold a draft token it was never fed (seen with the target as its own
  draft, which has every draft accepted).
"""

import random

import torch
from scipy.stats import chisquare

from conftest import run_all
from engine.config import EngineConfig
from engine.kv_rules import blocks_needed
from engine.llm_engine import LLMEngine
from engine.sampling_params import RequestOptions, SamplingParams

PROMPT = [5, 7, 9, 11, 13]


def test_sampled_output_keeps_the_target_distribution_with_k_2(make_engine, hf_target):
    """Joint law of tokens 2-3 (top-k 3, T 0.8) when they come from ONE k = 2 step.

    max_tokens 4 leaves room for k = 2 after the prefill token (k is capped by max_tokens - 1 -
    output so far), so token 3 is an accepted second draft, a recovered token at position 2 or
    the bonus: the second draft position's q matters. 9 cells given token 1, chi-square.
    """
    params = dict(temperature=0.8, top_k=3, max_tokens=4, ignore_eos=True)
    engine = make_engine(adaptive_k=False, max_num_seqs=64, max_waiting=4000)
    n = 3000
    for i in range(n):
        engine.add_request(f"s{i}", PROMPT, SamplingParams(**params), RequestOptions("speculative", k_max=2))
    outs, _ = run_all(engine)
    per_pos = engine.snapshot().num_accepted_tokens_per_pos
    assert len(per_pos) == 2 and per_pos[1] > 0, "no step ran (and accepted at) k = 2"

    def probs(prefix):
        with torch.no_grad():
            logits = hf_target(torch.tensor([prefix])).logits[0, -1] / 0.8
        top = logits.topk(3)
        return dict(zip(top.indices.tolist(), top.values.softmax(0).tolist()))

    p_values = []
    for t1, p1 in probs(PROMPT).items():                   # condition on the prefill token
        rows = [tuple(o[1:3]) for o in outs.values() if o[0] == t1]
        exact = {(t2, t3): p2 * p3 for t2, p2 in probs(PROMPT + [t1]).items()
                 for t3, p3 in probs(PROMPT + [t1, t2]).items()}
        counts = {cell: 0 for cell in exact}
        for r in rows:
            counts[r] += 1                                 # KeyError: outside the target's top-k
        cells = [c for c in sorted(exact) if exact[c] * len(rows) >= 5]
        if len(cells) < 2:
            continue
        observed = [counts[c] for c in cells] + [len(rows) - sum(counts[c] for c in cells)]
        expected = [exact[c] * len(rows) for c in cells]
        expected.append(len(rows) - sum(expected))
        p_values.append(chisquare(observed, expected).pvalue)
    assert p_values and min(p_values) > 1e-3 / len(p_values), p_values


def test_seeded_requests_ignore_the_global_rng_and_the_batch(tiny_family, odd_draft):
    """A seeded request's tokens depend on its seed alone: not on the global RNG, nor on who
    shares its batch. With a draft that disagrees often, every accept decision matters."""
    engine = LLMEngine(EngineConfig(str(tiny_family["target"]), str(odd_draft), profile=False,
                                    num_threads=1, kv_budget_bytes=8 << 20, adaptive_k=False))
    params = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=1234)
    spec = RequestOptions("speculative", k_max=3)
    torch.manual_seed(0)
    engine.add_request("alone", PROMPT, params, spec)
    alone, _ = run_all(engine)
    torch.manual_seed(99)
    for i in range(3):
        engine.add_request(f"other{i}", [9, 8, 7, i + 1], SamplingParams(temperature=1.0, max_tokens=32,
                           ignore_eos=True), spec)
    engine.add_request("batched", PROMPT, params, spec)
    batched, _ = run_all(engine)
    assert engine.snapshot().num_draft_tokens > engine.snapshot().num_accepted_tokens > 0
    assert batched["batched"] == alone["alone"]


def _squeezed_engine(tiny_family, **kw):
    return LLMEngine(EngineConfig(str(tiny_family["target"]), str(tiny_family["draft"]),
                                  profile=False, num_threads=1, adaptive_k=False,
                                  max_num_batched_tokens=64, **kw))


def _drive(engine, check, num_requests=16, seed=3):
    rng = random.Random(seed)
    pending = [(f"r{i}", [rng.randrange(1, 300) for _ in range(rng.randrange(3, 30))])
               for i in range(num_requests)]
    steps = 0
    while pending or engine.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                rid, prompt = pending.pop(0)
                engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=40,
                                   ignore_eos=True), RequestOptions("speculative", k_max=4))
        engine.step()
        check(engine)
        steps += 1
        assert steps < 5000
    assert engine.pool.num_free == engine.pool.num_blocks


def test_dropping_speculation_frees_the_draft_kv(tiny_family):
    engine = _squeezed_engine(tiny_family, kv_budget_bytes=10 * 2 * 2 * 2 * 16 * 4 * 16)

    def check(engine):
        running = engine.scheduler.running + list(engine.scheduler.waiting)
        for s in running:
            if not s.speculative:
                assert s.draft_blocks == [], f"{s.request_id} dropped speculation, kept draft KV"
        held = sum(len(s.draft_blocks) for s in running if s.speculative)
        assert engine.pool.used_by["draft"] == held
        if not any(s.speculative for s in running):
            assert engine.stats().kv_used_draft_bytes == 0

    _drive(engine, check)
    assert engine.scheduler.num_spec_downgrades > 0, "the budget was meant to force downgrades"


def test_rejected_drafts_blocks_are_trimmed_after_each_step(tiny_family):
    # 2 tokens a block: almost every rejection leaves a block past the kept tokens.
    engine = _squeezed_engine(tiny_family, kv_budget_bytes=64 << 20, block_size=2)
    tpb, dtpb = engine.pool.target.tokens_per_block, engine.pool.draft.tokens_per_block

    def check(engine):
        for s in engine.scheduler.running:
            keep = len(s.token_ids)
            assert len(s.blocks) <= blocks_needed(keep, tpb), s.request_id
            assert len(s.draft_blocks) <= blocks_needed(keep, dtpb), s.request_id

    _drive(engine, check)
    snap = engine.snapshot()
    assert snap.num_draft_tokens > snap.num_accepted_tokens, "no draft was ever rejected"


def test_the_target_as_its_own_draft_has_every_draft_accepted(make_engine, tiny_family):
    """With the target as the draft, greedy drafts are the target's own tokens, so every one is
    accepted, in every step and at every k. A draft that reads KV it never wrote, or misses
    KV it wrote, proposes something else now and then; the output stays the target's (it is
    verified), so only the acceptance shows it.

    Breaks when `_apply` rolls the draft's KV back one token too far forward after a step
    that accepted all k (`draft_computed = old_len + r.accepted`: the last draft token was
    never fed to the draft)."""
    engine = make_engine(draft=tiny_family["target"], adaptive_k=False)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", [5 + i, 7, 9 + 2 * i, 11] * (1 + i), params,
                           RequestOptions("speculative", k_max=1 + i))
    run_all(engine)
    snap = engine.snapshot()
    assert snap.num_draft_tokens > 100 and snap.num_accepted_tokens == snap.num_draft_tokens
