import os

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def make_engine(tiny_family):
    def make(draft=True, **kw):
        """draft: True for the tiny family's draft, False for none, or a model folder."""
        kw.setdefault("kv_budget_bytes", 8 << 20)
        kw.setdefault("profile", False)
        kw.setdefault("num_threads", 1)
        # float32 unless SPECSERVE_TEST_DTYPE says otherwise (the suite is also run in bfloat16:
        # greedy identity with transformers' fp32 generate is then not expected, the rest is).
        kw.setdefault("dtype", os.environ.get("SPECSERVE_TEST_DTYPE", "float32"))
        if draft is True:
            draft = tiny_family["draft"]
        return LLMEngine(EngineConfig(str(tiny_family["target"]), str(draft) if draft else None,
                                      **kw))
    return make


@pytest.fixture(scope="module")
def hf_target(tiny_family):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_family["target"])).eval()


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
    return out[0, len(prompt):].tolist()


def run_all(engine, arrivals=None):
    """Step until done; arrivals: {step_index: [(request_id, prompt, params, options)]}."""
    outs, finals, step = {}, {}, 0
    arrivals = dict(arrivals or {})
    while engine.has_unfinished() or arrivals:
        for args in arrivals.pop(step, []):
            engine.add_request(*args)
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                finals[o.request_id] = o
        step += 1
        assert step < 10_000
    return outs, finals


def three_token_pvalue(probs_after, outs: dict, n: int) -> float:
    """Chi-square p-value of `n` sampled 3-token continuations (`outs`: id -> tokens) against
    their exact probability, the product of `probs_after(prefix)` ({token: p} after the tokens
    so far). Cells expected fewer than 5 times are pooled into one. A sampled token outside
    the exact support raises KeyError (a token the processed distribution gives no mass)."""
    from scipy.stats import chisquare

    exact = {}
    for t1, p1 in probs_after([]).items():
        for t2, p2 in probs_after([t1]).items():
            for t3, p3 in probs_after([t1, t2]).items():
                exact[(t1, t2, t3)] = p1 * p2 * p3
    counts = {cell: 0 for cell in exact}
    for toks in outs.values():
        counts[tuple(toks)] += 1
    cells = sorted(exact)
    observed = [counts[c] for c in cells]
    expected = [exact[c] * n for c in cells]
    big = [i for i, e in enumerate(expected) if e >= 5]
    obs, exp = [observed[i] for i in big], [expected[i] for i in big]
    rest_o, rest_e = n - sum(obs), n - sum(exp)
    if rest_e > 1e-6:
        obs, exp = obs + [rest_o], exp + [rest_e]
    return chisquare(obs, exp).pvalue
