"""Continuous batching under one KV byte budget.

Owns: which sequences run in the next step, how many of their tokens are fed (prefill chunks),
how many draft tokens each proposes (k, from the adaptive rule), and the blocks for all of it.
Requests join and leave between steps. Does not own: the forward passes or sampling.

Memory rule (docs/architecture.md; why: docs/decisions/0001-draft-kv-in-one-budget.md): a step
only runs when every block it writes is allocated. When blocks run short the scheduler first
drops speculation for the lowest-priority sequences (k = 0, draft KV freed, mode -> baseline for
good), and only then preempts the lowest-priority sequences (all KV freed; they are prefilled
again later, with the same tokens). New speculative requests are admitted as baseline when
headroom is low. The admission test, that threshold and the victim order are the pure functions
of `engine/kv_rules.py`, which the simulator's replicas apply too. Nothing allocates outside
this module, so the pool can never be overdrawn.

Prefix caching (docs/decisions/0028-prefix-caching.md): a full block whose KV a prompt chunk
computed is keyed by its prefix (`engine/prefix_cache.py`), as is a full draft block, and stays
in the pool after its sequences finish. An admitted sequence holds the longest keyed prefix it
finds and prefills only the rest: `prefix_unit` tokens at a time (a multiple of the block and of
`prefill_align`, so the rest is cut and attended exactly as without the cache and the KV is the
same bits), never its last prompt token (its logits are needed). A speculative sequence also
holds the draft's cached blocks of that prefix, as far as they go; its draft feeds the rest
when it first drafts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine import kv_rules
from engine.kv_cache import BlockPool
from engine.kv_rules import blocks_needed
from engine.prefix_cache import chain_keys
from engine.sampling_params import FinishReason, Mode
from engine.sequence import Sequence, Status

# choose_k(acceptance per sequence, k_max per sequence, context tokens, prefill tokens,
#          tokens each sequence's draft must feed before it can propose (its catch-up),
#          tokens each sequence may still emit) -> k per sequence
ChooseK = Callable[[list[float], list[int], int, int, list[int], list[int]], list[int]]


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_feed: int     # tokens of seq.token_ids fed to the target this step, from num_computed
    k: int            # draft tokens proposed this step (0: plain decoding or a prefill chunk)
    prefill_align: int = 0   # a prompt chunk: its attention pieces (engine/attention.py)

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence, so this step emits tokens for it."""
        return self.seq.num_computed + self.num_feed == len(self.seq.token_ids)


@dataclass
class SchedulerLimits:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    spec_min_free_fraction: float = kv_rules.SPEC_MIN_FREE_FRACTION   # below this headroom, new
    #   requests do not speculate (`kv_rules.keeps_speculation`)
    # How a step that carries prompt tokens (a request admitted now, or a prompt's next chunk)
    # treats the decoding batch; the new request's first token waits for that step:
    #   "mixed": the batch decodes and drafts in it as in any step (throughput first);
    #   "no_draft": the batch decodes but runs no draft rounds, which would lengthen the step by
    #     up to k forwards of the draft plus a verify of k + 1 tokens a sequence
    #     (docs/decisions/0008-prefill-mode.md);
    #   "alone": the prompts run in a step of their own, as SGLang's prefill batches and vLLM's
    #     V0 scheduler: the first token waits for the step under way and a short prefill, not for
    #     a speculative step of the whole batch. The batch sits out that step (never two in a
    #     row, so decoding cannot starve); each arrival costs one forward's fixed cost.
    prefill_mode: str = "mixed"
    # Prompts are cut into chunks only at multiples of this many tokens (or at their end), and
    # attention runs a chunk in pieces cut at the same multiples (`engine/attention.py`), so a
    # prompt's KV is the same bits however the token budget cut it, that is under any load.
    prefill_align: int = 64
    prefix_caching: bool = True      # reuse cached prompt blocks (docs/decisions/0028-...)


class Scheduler:
    def __init__(self, pool: BlockPool, limits: SchedulerLimits, choose_k: ChooseK,
                 acceptance: Callable[[Sequence], float],
                 may_draft: Callable[[int], bool] | None = None):
        self.pool, self.limits = pool, limits
        self.choose_k, self.acceptance = choose_k, acceptance
        # asked first, with the decoding batch's size: False settles k = 0 for every sequence
        # without the k rule's inputs or the rule (the engine's goodput check)
        self.may_draft = may_draft or (lambda batch: True)
        self.tpb = pool.target.tokens_per_block
        self.draft_tpb = pool.draft.tokens_per_block if pool.draft else 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_spec_downgrades = 0
        self.truncated: list[Sequence] = []   # finished here (KV outgrown); the engine reports them
        self.last_alone = False               # the last step ran prompts alone (prefill_mode)
        self.prefix_unit = kv_rules.prefix_unit(self.tpb, limits.prefill_align)
        self.draft_root = b"draft:0"          # the draft's key root; a new draft, a new root
        self.prefix_queries = 0               # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0                  # of them, found cached (their prefill skipped)

    # ---- membership -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if self.pool.draft is None:
            seq.mode = Mode.BASELINE
        self.waiting.append(seq)

    def fits_ever(self, num_tokens: int) -> bool:
        return blocks_needed(num_tokens, self.tpb) <= self.pool.num_blocks

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark finished and free every block at once (also used for aborts)."""
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self._free_all(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.truncated)

    def _truncate(self, seq: Sequence) -> None:
        """The sequence outgrew the whole pool: it ends with `length` (its final output is the
        engine's job, from `take_truncated`), never silently."""
        self.finish(seq, FinishReason.LENGTH)
        self.truncated.append(seq)

    def take_truncated(self) -> list[Sequence]:
        out, self.truncated = self.truncated, []
        return out

    # ---- block bookkeeping ------------------------------------------------------------------
    def _free_all(self, seq: Sequence) -> None:
        self.register(seq)
        self.pool.free(seq.blocks[::-1], "target")
        seq.blocks, seq.num_keyed = [], 0
        self._free_draft(seq)

    def _free_draft(self, seq: Sequence, keep: bool = True) -> None:
        """keep: key its complete blocks first, so the cache keeps them (not stale ones)."""
        if keep:
            self.register(seq)
        self.pool.free(seq.draft_blocks[::-1], "draft")
        seq.draft_blocks, seq.num_draft_keyed = [], 0
        seq.draft_computed = 0

    def reset_draft(self, seq: Sequence) -> None:
        """Free the draft KV but keep the mode: the draft re-prefills when it next drafts
        (after a draft swap, whose new weights make the old KV stale: `new_draft`)."""
        self._free_draft(seq, keep=False)

    def new_draft(self, generation: int) -> None:
        """Another draft's weights run from now: cached draft blocks no longer match (they
        are evicted as they age)."""
        self.draft_root = b"draft:%d" % generation

    # ---- prefix caching ---------------------------------------------------------------------
    def register(self, seq: Sequence) -> None:
        """Key seq's full blocks whose KV is complete and final: the target's that prompt
        chunks computed (before `prefill_end`; a decode's KV is other bits than a prefill's),
        the draft's before `draft_computed`."""
        if not self.limits.prefix_caching:
            return
        cache = self.pool.cache
        n = min(seq.num_computed, seq.prefill_end, len(seq.blocks) * self.tpb) // self.tpb
        if n > seq.num_keyed:
            keys = chain_keys(seq.token_ids, self.tpb, b"target", seq.block_keys, n)
            for j in range(seq.num_keyed, n):
                cache.register(seq.blocks[j], keys[j])
            seq.num_keyed = n
        n = min(seq.draft_computed, len(seq.token_ids), len(seq.draft_blocks) * self.draft_tpb)
        n //= self.draft_tpb or 1
        if n > seq.num_draft_keyed:
            if seq.draft_keys_root != self.draft_root:
                seq.draft_keys, seq.draft_keys_root = [], self.draft_root
            keys = chain_keys(seq.token_ids, self.draft_tpb, self.draft_root, seq.draft_keys, n)
            for j in range(seq.num_draft_keyed, n):
                cache.register(seq.draft_blocks[j], keys[j])
            seq.num_draft_keyed = n

    def _take_cached(self, seq: Sequence) -> None:
        """Give a sequence with no KV the longest cached prefix it may reuse (not yet held:
        `_hold_cached`), and skip its prefill there. A sequence that asks for its prompt's
        logprobs takes none: it needs every prompt row (as vLLM, which skips the lookup too)."""
        if not self.limits.prefix_caching or seq.num_computed or seq.prompt_logprobs is not None:
            return
        cache, unit = self.pool.cache, self.prefix_unit
        keys = chain_keys(seq.token_ids, self.tpb, b"target", seq.block_keys,
                          (seq.prefill_end - 1) // self.tpb)
        blocks = cache.lookup(keys)
        length = kv_rules.reusable_prefix(seq.prefill_end, len(blocks) * self.tpb, unit)
        if seq.speculative and length:
            if seq.draft_keys_root != self.draft_root:
                seq.draft_keys, seq.draft_keys_root = [], self.draft_root
            # The draft's cached blocks up to the target's prefix (whole, short of the last
            # prompt token); the draft feeds the rest in its first round, as after any pause.
            # The target's hit does not wait for them: a conversation whose draft sat out a
            # turn (k = 0) would otherwise recompute its history every turn after.
            num = min(-(-length // self.draft_tpb), (seq.prefill_end - 1) // self.draft_tpb)
            keys = chain_keys(seq.token_ids, self.draft_tpb, self.draft_root, seq.draft_keys, num)
            seq.draft_blocks = cache.lookup(keys)
            seq.draft_computed = len(seq.draft_blocks) * self.draft_tpb
        seq.blocks = blocks[:length // self.tpb]
        seq.num_computed = length

    def _hold_cached(self, seq: Sequence) -> None:
        """The sequence is admitted: it holds its cached prefix (counted once, however many
        hold it)."""
        self.pool.share(seq.blocks, "target")
        self.pool.share(seq.draft_blocks, "draft")
        seq.num_keyed, seq.num_draft_keyed = len(seq.blocks), len(seq.draft_blocks)
        self.prefix_queries += seq.prefill_end
        self.prefix_hits += seq.num_computed

    def _drop_cached(self, seq: Sequence) -> None:
        """Not admitted this step: back to no KV."""
        seq.blocks, seq.draft_blocks, seq.num_computed, seq.draft_computed = [], [], 0, 0

    def _need(self, item: ScheduledSeq) -> tuple[int, int]:
        s = item.seq
        target = blocks_needed(s.num_computed + item.num_feed + item.k, self.tpb) - len(s.blocks)
        draft = 0
        if item.k:
            draft = blocks_needed(len(s.token_ids) + item.k - 1, self.draft_tpb) - len(s.draft_blocks)
        return max(target, 0), max(draft, 0)

    def trim(self, seq: Sequence) -> None:
        """After a step: free blocks past what the kept tokens need (rejected drafts' slots)."""
        keep = blocks_needed(len(seq.token_ids), self.tpb)
        if len(seq.blocks) > keep:
            self.pool.free(seq.blocks[keep:], "target")
            del seq.blocks[keep:]
        if seq.draft_blocks:
            keep = blocks_needed(len(seq.token_ids), self.draft_tpb)
            if len(seq.draft_blocks) > keep:
                self.pool.free(seq.draft_blocks[keep:], "draft")
                del seq.draft_blocks[keep:]

    # ---- the decision -----------------------------------------------------------------------
    def _downgrade(self, seq: Sequence) -> None:
        seq.mode = Mode.BASELINE
        self._free_draft(seq)
        self.num_spec_downgrades += 1

    def drop_speculation(self, seq: Sequence) -> None:
        """Baseline for good, draft KV freed (the draft failed, or memory is short)."""
        if seq.speculative or seq.draft_blocks:
            self._downgrade(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._free_all(seq)
        self.running.remove(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledSeq]:
        """The next step: (1) running sequences' decode items, with k, and prompt chunks;
        (2) speculation dropped, then sequences preempted, until its blocks fit; (3) waiting
        sequences admitted while tokens, sequence slots and blocks allow."""
        limits = self.limits
        for s in self.running:           # what the last step completed, for admissions now
            self.register(s)
        budget = limits.max_num_batched_tokens
        items: dict[int, ScheduledSeq] = {}
        mode = limits.prefill_mode
        carries = mode != "mixed" and self._carries_prompt(budget)
        alone = mode == "alone" and carries and not self.last_alone
        self.last_alone = alone
        decode = [] if alone else [s for s in self.running if not s.in_prefill]
        ks = {}
        if any(s.speculative for s in decode) and not (mode == "no_draft" and carries):
            ks = self._choose_ks(decode, budget)
        for s in self.running:
            if s.in_prefill:
                # At least one piece: a prompt under way always advances.
                n = self._chunk(s, budget, at_least_one=True)
                items[id(s)] = ScheduledSeq(s, n, 0, limits.prefill_align)
                budget -= n
            elif not alone:
                k = ks.get(id(s), 0)
                items[id(s)] = ScheduledSeq(s, len(s.token_ids) - s.num_computed, k)
                budget -= 1 + k
        self._make_room(items)
        for it in items.values():
            self._allocate(it)
        self._admit(items, budget)
        return list(items.values())

    def _choose_ks(self, decode: list[Sequence], budget: int) -> dict[int, int]:
        """k for each decoding sequence, by id. Every decoding sequence enters the k decision
        (k_max 0 in baseline mode: it pays for draft rounds too); prefill riding in the same
        forward is passed as extra tokens."""
        limits = self.limits
        room = [max(0, min(s.options.k_max, limits.max_model_len - len(s.token_ids) - 1,
                           s.params.max_tokens - s.num_output - 1)) if s.speculative else 0
                for s in decode]
        if not any(room) or not self.may_draft(len(decode)):
            return {id(s): 0 for s in decode}
        prefill = sum(len(s.token_ids) - s.num_computed for s in self.running if s.in_prefill)
        context = sum(len(s.token_ids) for s in decode)
        # A draft on time lags by 1-2 tokens (the last step's bonus and accepted ones), which
        # its round feeds anyway; one that has never run (draft_computed 0) first feeds the
        # whole context, one stopped for a while every token it skipped.
        catch_up = [len(s.token_ids) - s.draft_computed - 2 if s.draft_computed
                    else len(s.token_ids) for s in decode]
        left = [min(s.params.max_tokens - s.num_output, limits.max_model_len - len(s.token_ids))
                for s in decode]
        chosen = self.choose_k([self.acceptance(s) for s in decode], room, context,
                               min(prefill, budget), [max(0, n) for n in catch_up], left)
        return {id(s): k for s, k in zip(decode, chosen)}

    def _make_room(self, items: dict[int, ScheduledSeq]) -> None:
        """Until the step's blocks fit: speculation dropped, then sequences preempted, in the
        order of the shared rule (`kv_rules.next_victim`); a sequence alone and still too long
        for the whole pool is truncated. Victims are chosen among all running sequences, so in
        a step of prompts alone also among the decoding ones that sit it out (no item here)."""
        while sum(sum(self._need(it)) for it in items.values()) > self.pool.num_free:
            victim, drops = kv_rules.next_victim(
                self.running, lambda s: s.options.priority, lambda s: s.arrival,
                lambda s: s.speculative and bool((id(s) in items and items[id(s)].k)
                                                 or s.draft_blocks))
            if drops:
                if id(victim) in items:
                    items[id(victim)].k = 0
                self._downgrade(victim)
                continue
            if len(self.running) == 1:
                self._truncate(victim)
            else:
                self._preempt(victim)
            items.pop(id(victim), None)

    def _admit(self, items: dict[int, ScheduledSeq], budget: int) -> None:
        """Waiting sequences join the step while tokens, sequence slots and blocks allow, by the
        shared admission test and downgrade threshold (`engine/kv_rules.py`)."""
        limits = self.limits
        while self.waiting and len(self.running) < limits.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not self.fits_ever(len(seq.token_ids)):   # preempted after growing past the pool
                self._truncate(seq)
                continue
            self._take_cached(seq)
            n = self._chunk(seq, budget)
            item = ScheduledSeq(seq, n, 0, limits.prefill_align)
            # holding a cached block nobody holds takes it out of the free count
            need = self._need(item)[0] + self.pool.num_unheld(seq.blocks + seq.draft_blocks)
            if n == 0 or not kv_rules.fits_beside_growth(need, self.pool.num_free,
                                                         len(self.running), 1):
                self._drop_cached(seq)   # no piece fits the token budget, or no blocks
                break
            self.waiting.popleft()
            self._hold_cached(seq)
            if seq.speculative and not kv_rules.keeps_speculation(
                    self.pool.num_free - need, self.pool.num_blocks, limits.spec_min_free_fraction):
                self._downgrade(seq)
            self._allocate(item)
            seq.status = Status.RUNNING
            self.running.append(seq)
            items[id(seq)] = item
            budget -= n

    def _chunk(self, seq: Sequence, budget: int, at_least_one: bool = False) -> int:
        """Prompt tokens of seq to feed within `budget`: up to the end of its prompt, else up to
        the last multiple of `prefill_align` the budget reaches (0 when it reaches none; with
        at_least_one, up to the next multiple)."""
        left = seq.prefill_end - seq.num_computed
        if left <= budget:
            return left
        align = self.limits.prefill_align
        stop = (seq.num_computed + max(budget, 0)) // align * align
        if at_least_one:
            stop = max(stop, (seq.num_computed // align + 1) * align)
        return max(0, min(stop - seq.num_computed, left))

    def _carries_prompt(self, budget: int) -> bool:
        """Whether this step will carry prompt tokens: a prompt's next chunk, or the first
        waiting sequence fitting now (as step 3 of `schedule` sees it before any decode blocks
        are taken): a queue that waits for memory or a slot is not a prompt arriving, and must
        not hold speculation off."""
        if any(s.in_prefill for s in self.running):
            return True
        if not self.waiting or len(self.running) >= self.limits.max_num_seqs:
            return False
        seq = self.waiting[0]
        n = self._chunk(seq, budget)
        if n == 0:                       # not one piece fits: the prompt waits this step
            return False
        # the admission test on what the decoding sequences leave (at most a block each)
        return kv_rules.fits_beside_growth(self._need(ScheduledSeq(seq, n, 0))[0],
                                           self.pool.num_free - len(self.running), len(self.running), 1)

    def _allocate(self, item: ScheduledSeq) -> None:
        target, draft = self._need(item)
        s = item.seq
        if target:
            s.blocks += self.pool.allocate(target, "target", s.blocks[-1] if s.blocks else None)
        if draft:
            last = s.draft_blocks[-1] if s.draft_blocks else None
            s.draft_blocks += self.pool.allocate(draft, "draft", last)
