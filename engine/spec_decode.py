"""One engine step: draft proposes, target verifies, rejection sampling (or the coupling) accepts.

The loop reads top to bottom (as gpt-fast's `speculative_decode`, batched): 1. the draft runs k
rounds over the speculative sequences (its first round also catches up on tokens it has not
seen); 2. the target runs ONE forward over every scheduled sequence, each contributing its
unseen tokens plus its k drafts; 3. the rejection sampler keeps accepted + 1 tokens per sequence.
Sequences with k = 0 (baseline, or speculation not paying this step) ride in the same forward.
If the draft fails (an exception in its forward), the step goes on without it: its sequences
verify with k = 0 and their results say `draft_error`, so the engine drops them to baseline.
Seeded requests use the Gumbel-max coupling instead of rejection sampling, so their text does not
depend on k (`engine/coupled_sampler.py`). Penalties, logit bias and grammars process the draft's
and the target's rows alike, position by position, before any of it
(`engine/logits_processors.py`).
The math lives in `engine/sampler.py` and `engine/rejection_sampler.py`; the KV rollback is only
a count (`num_computed`), since slots past it are simply overwritten later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import SeqSlice
from engine.coupled_sampler import coupled_seed, couple_rows
from engine.logits_processors import process
from engine.host_sync import StepClock, upload
from engine.logprobs import TokenLogprob, prompt_rows, row_logprobs
from engine.model_runner import ModelRunner
from engine.rejection_sampler import rejection_sample
from engine.sampler import RowParams, greedy_tokens, probabilities, sample, uniforms
from engine.scheduler import ScheduledSeq


@dataclass
class StepTimes:
    """Where a step's time went, for the engine's cost calibration (`CalibratedCost.calibrate`)."""
    draft_s: float = 0.0     # the draft rounds (0 if none ran)
    verify_s: float = 0.0    # the target's forward


@dataclass
class StepResult:
    item: ScheduledSeq
    accepted: int            # draft tokens accepted (0 when k == 0)
    tokens: list[int]        # emitted tokens: accepted drafts + one recovered/bonus token
    draft_error: BaseException | None = None   # the draft failed this step (k was set to 0)
    logprobs: list[TokenLogprob] | None = None         # one per emitted token, if asked
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens this chunk scored, if asked
    logits: torch.Tensor | None = None  # RequestOptions.keep_logits: [emitted, vocab] bf16 rows


def propose(draft: ModelRunner, items: list[ScheduledSeq], rp: RowParams, greedy: bool,
            seeds: list):
    """k_i draft tokens for each item -> (drafted, flat_ids, flat_q): flat_ids [sum k] the
    drafts on the device, item after item, flat_q [sum k, vocab] their draft probabilities
    (None when every row is greedy), drafted[i] the k_i ids of item i as host lists, only where
    a logits processor needs them (else None: the drafts stay on the device, and each round
    feeds the last round's tokens to the next without a host read).

    seeds[i]: the coupled sampler's seed for item i (None: sample from q with its generator).
    """
    processing = any(it.seq.processor is not None for it in items)
    drafted: list[list[int]] | None = [[] for _ in items] if processing else None
    rounds, order, q_rounds = [], [], []    # each round's tokens [active], and (item, round)
    last, prev_active = None, []
    for j in range(max(it.k for it in items)):
        active = [i for i, it in enumerate(items) if it.k > j]
        seqs, pos, rows, ids = [], [], [], []
        for i in active:
            s = items[i].seq
            if j == 0:   # catch up on everything the draft has not seen, ending with the last token
                start, num = s.draft_computed, len(s.token_ids) - s.draft_computed
                ids += s.token_ids[start:]
            else:
                start, num = len(s.token_ids) + j - 1, 1
            seqs.append(SeqSlice(s.draft_blocks, start, num))
            pos += range(start, start + num)
            rows.append(len(pos) - 1)
        if j > 0:       # the last round's tokens of the items still drafting
            ids = last if active == prev_active else last[
                upload([prev_active.index(i) for i in active], torch.long, last.device)]
        logits = draft.run(seqs, ids, pos, rows)                            # [len(active), vocab]
        if processing:
            logits = process(logits, [(items[i].seq, drafted[i]) for i in active])
        if greedy:
            tokens = greedy_tokens(logits)
        else:
            sub = rp.select(active)
            q = probabilities(logits, sub)
            tokens = couple_rows(sample(q, sub.generators), q, [seeds[i] for i in active],
                                 [len(items[i].seq.token_ids) + j for i in active])
            q_rounds.append(q)
        if processing:
            for i, t in zip(active, tokens.tolist()):
                drafted[i].append(t)
        rounds.append(tokens)
        order += [(i, j) for i in active]
        last, prev_active = tokens, active
    for it in items:   # provisional: corrected to the accepted prefix after verification
        it.seq.draft_computed = len(it.seq.token_ids) + it.k - 1
    # the rounds' rows, round after round, reordered item after item
    where = {key: n for n, key in enumerate(order)}
    perm = upload([where[(i, j)] for i, it in enumerate(items) for j in range(it.k)],
                  torch.long, draft.device)
    flat_ids = torch.cat(rounds)[perm]
    flat_q = None if greedy else torch.cat(q_rounds)[perm]
    return drafted, flat_ids, flat_q


def step(items: list[ScheduledSeq], target: ModelRunner,
         draft: ModelRunner | None) -> tuple[list[StepResult], StepTimes]:
    """The step's results, one per item, and the time its draft rounds and its target forward
    took (`StepTimes`). A decode step reads the device once, for the accepted tokens
    (`rejection_sample`); the drafts reach the verify forward on the device."""
    sampling = [it for it in items if it.samples]
    spec = spec_items = [it for it in sampling if it.k > 0]
    greedy = all(it.seq.params.greedy for it in sampling)
    seeds = [coupled_seed(it.seq.params) for it in sampling]    # None: rejection sampling
    rp = RowParams.build([it.seq.params for it in sampling],
                         [it.seq.generator for it in sampling], target.device)
    clock = StepClock(target.device)
    drafted, draft_error = {}, None
    draft_ids, draft_q = torch.empty(0, dtype=torch.long, device=target.device), None
    if spec:
        spec_rows = [i for i, it in enumerate(sampling) if it.k > 0]
        clock.mark("draft")
        try:
            lists, draft_ids, draft_q = propose(draft, spec, rp.select(spec_rows), greedy,
                                                [seeds[i] for i in spec_rows])
            drafted = {id(it): d for it, d in zip(spec, lists)} if lists is not None else {}
            clock.mark("drafted")
        except Exception as exc:       # the draft is down: verify these sequences with k = 0
            draft_error = exc
            for it in spec:
                it.k = 0
            spec = []
            draft_ids = torch.empty(0, dtype=torch.long, device=target.device)

    # Verify: one target forward over every scheduled sequence, the drafts written into its
    # token ids on the device.
    seqs, ids, pos, rows, scored, slots = _verify_feed(items)
    if slots:     # (without drafts the ids stay a host list: other ranks take it in the message)
        ids = upload(ids, torch.long, target.device)
        ids.index_copy_(0, upload(slots, torch.long, target.device), draft_ids)
    num_rows = len(rows) if sampling else 1
    extra = [r for pairs in scored.values() for r, _ in pairs]
    clock.mark("verify")
    logits = target.run(seqs, ids, pos, (rows if sampling else [0]) + extra)
    clock.mark("verified")
    prompt_lp = _prompt_logprobs(items, scored, logits[num_rows:])
    if not sampling:
        return [StepResult(it, 0, [], prompt_logprobs=prompt_lp.get(id(it)))
                for it in items], StepTimes(clock.seconds("draft", "drafted"),
                                            clock.seconds("verify", "verified"))
    logits = logits[:num_rows]                                         # [sum(k+1), vocab]
    # Verify row j of a sequence is processed as if its first j drafts were emitted, as the
    # draft's round j was (engine/logits_processors.py).
    if any(it.seq.processor is not None for it in sampling):
        logits = process(logits, [(it.seq, drafted.get(id(it), [])[:j])
                                  for it in sampling for j in range(it.k + 1)])

    # Accept: flat drafts over the sampling sequences (k = 0 for those not speculating).
    # Seeded rows: the target's choice is its coupled sample and the rule is greedy
    # verification on it (engine/coupled_sampler.py); the others keep rejection sampling.
    ks = [it.k for it in sampling]
    choice, p, u = greedy_tokens(logits), None, None
    if not greedy:
        per_row = [i for i, k in enumerate(ks) for _ in range(k + 1)]
        p = probabilities(logits, rp.select(per_row))
        u = uniforms(ks, rp.generators, target.device)
        if any(s is not None for s in seeds):      # per-row bookkeeping only when needed
            positions = [len(it.seq.token_ids) + j for it in sampling for j in range(it.k + 1)]
            choice = couple_rows(choice, p, [seeds[i] for i in per_row], positions)
    rule_greedy = [it.seq.params.greedy or s is not None for it, s in zip(sampling, seeds)]
    accepted, emitted = rejection_sample(draft_ids, ks, choice, rule_greedy,
                                         p, draft_q, u, rp.generators)
    # (the device has run the step: its clock can be read)
    times = StepTimes(clock.seconds("draft", "drafted"), clock.seconds("verify", "verified"))
    failed = {id(it) for it in spec_items} if draft_error is not None else set()
    token_lp = _emitted_logprobs(sampling, ks, emitted, logits)
    kept = _emitted_logits(sampling, ks, emitted, logits)
    results = {id(it): StepResult(it, a, t, draft_error if id(it) in failed else None,
                                  token_lp.get(id(it)), prompt_lp.get(id(it)), kept.get(id(it)))
               for it, a, t in zip(sampling, accepted, emitted)}
    return [results.get(id(it), StepResult(it, 0, [], prompt_logprobs=prompt_lp.get(id(it))))
            for it in items], times


def _verify_feed(items: list[ScheduledSeq]):
    """The verify forward's inputs: each item's slice, the flat ids and positions (its chunk or
    last token, then its k drafts, as 0 here), the rows whose logits sample (k + 1 per sampling
    item), {id(item): [(flat row, prompt token it scores)]} for the items scoring their prompt,
    and the flat rows where the drafts go, item after item (`propose`'s flat order)."""
    seqs, ids, pos, rows, scored, slots = [], [], [], [], {}, []
    for it in items:
        s, k = it.seq, it.k if it.samples else 0
        feed = s.token_ids[s.num_computed:s.num_computed + it.num_feed]
        seqs.append(SeqSlice(s.blocks, s.num_computed, len(feed) + k, it.prefill_align))
        if s.prompt_logprobs is not None:
            scored[id(it)] = [(len(ids) + p - s.num_computed, s.token_ids[p + 1]) for p in
                              prompt_rows(len(s.prompt_logprobs), s.num_computed, it.num_feed,
                                          s.num_prompt)]
        ids += feed
        slots += range(len(ids), len(ids) + k)
        ids += [0] * k
        pos += range(s.num_computed, s.num_computed + len(feed) + k)
        if it.samples:
            rows += range(len(ids) - k - 1, len(ids))
    return seqs, ids, pos, rows, scored, slots


def _emitted_rows(ks: list[int], emitted: list[list[int]], items: list[int]) -> list[int]:
    """The rows of `logits` [sum(k+1), vocab] at which items `items` chose their emitted
    tokens: item i's rows start at sum(k_j + 1, j < i), and its j-th emitted token (an accepted
    draft, or the recovered / bonus token) is chosen at its row j."""
    starts = [0]
    for k in ks:
        starts.append(starts[-1] + k + 1)
    return [starts[i] + j for i in items for j in range(len(emitted[i]))]


def _emitted_logprobs(sampling: list[ScheduledSeq], ks: list[int], emitted: list[list[int]],
                      logits: torch.Tensor) -> dict:
    """{id(item): [TokenLogprob] per emitted token} for the items that asked. The verify
    forward already holds every value: no extra forward, and only the asking rows are scored."""
    asking = [(i, it) for i, it in enumerate(sampling) if it.seq.params.logprobs is not None]
    if not asking:
        return {}
    flat = _emitted_rows(ks, emitted, [i for i, _ in asking])
    tokens = [t for i, _ in asking for t in emitted[i]]
    tops = [it.seq.params.logprobs for i, it in asking for _ in emitted[i]]
    scored = iter(row_logprobs(logits[torch.tensor(flat, dtype=torch.long, device=logits.device)],
                               tokens, tops))
    return {id(it): [next(scored) for _ in emitted[i]] for i, it in asking}


def _emitted_logits(sampling: list[ScheduledSeq], ks: list[int], emitted: list[list[int]],
                    logits: torch.Tensor) -> dict:
    """{id(item): [emitted, vocab] bfloat16} the rows each emitted token was chosen at (after
    logits processing, before temperature), for the items that keep them."""
    keeping = [i for i, it in enumerate(sampling) if it.seq.options.keep_logits]
    if not keeping:
        return {}
    flat = _emitted_rows(ks, emitted, keeping)
    rows = logits[torch.tensor(flat, dtype=torch.long, device=logits.device)].to(torch.bfloat16).cpu()
    return dict(zip((id(sampling[i]) for i in keeping),
                    rows.split([len(emitted[i]) for i in keeping])))


def _prompt_logprobs(items: list[ScheduledSeq], scored: dict, logits: torch.Tensor) -> dict:
    """{id(item): [TokenLogprob] per prompt token scored} from the prefill rows of the items
    that asked (logits [sum of their rows, vocab], in `scored`'s order)."""
    if not scored:
        return {}
    tops = [it.seq.params.prompt_logprobs for it in items if id(it) in scored
            for _ in scored[id(it)]]
    lps = iter(row_logprobs(logits, [t for pairs in scored.values() for _, t in pairs], tops))
    return {key: [next(lps) for _ in rs] for key, rs in scored.items()}
