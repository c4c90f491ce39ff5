"""Logits processing a request asks for: penalties, logit bias and a grammar mask.

Owns: turning a forward's [num_rows, vocab_size] logits into the processed logits that
`engine/sampler.py` (temperature, top-k, top-p, greedy) then reads, and each sequence's state
for it (its output tokens' counts, its grammar state). Does not own sampling nor the accept rule.

Per row, in this order (logits l, vocabulary entry v):
- **repetition penalty** (vLLM's): for v in the prompt or the output, l_v / r if l_v > 0, else
  l_v * r;
- **frequency and presence penalties** (OpenAI's): l_v -= c_v * frequency + (c_v > 0) * presence,
  c_v the count of v in the output so far (the prompt does not count);
- **logit bias**: l_v += bias_v;
- **grammar**: l_v = -inf for every v the grammar does not allow in its current state.

Exact under speculation: `process` is called once per forward, on the draft's rows in each round
(`spec_decode.propose`) and on the target's verify rows (`spec_decode.step`), with the same
function. Row j of a sequence (its j-th draft round, or its j-th verify row) is processed as if
the tokens drafted before j had been emitted: they count as output and advance the grammar. The
accepted prefix IS those tokens, so each emitted token comes from (or is verified against) the
distribution plain decoding processes at its position, and the rejection rule compares processed
q with processed p. A sequence's own state advances only through emitted tokens (`sync`), so a
rejection needs no rollback. Rows of requests without processing are not touched.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from engine.errors import InvalidParamError
from engine.grammar import Grammar, GrammarCompiler, GrammarError
from engine.sequence import Status


class RequestProcessor:
    """One sequence's processing settings and its state over the output emitted so far."""

    def __init__(self, params, num_prompt: int, vocab_size: int,
                 grammar: Grammar | Future | None = None):
        self.presence = float(params.presence_penalty)
        self.frequency = float(params.frequency_penalty)
        self.repetition = float(params.repetition_penalty)
        self.bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        self.bias_values = torch.tensor([float(b) for _, b in params.logit_bias])
        self.compiling = grammar if isinstance(grammar, Future) else None
        self.grammar = None if self.compiling is not None else grammar
        self.num_prompt = num_prompt
        self.vocab_size = vocab_size
        self.counts: torch.Tensor | None = None     # [vocab_size] float, output tokens so far
        self.seen: torch.Tensor | None = None       # [vocab_size] bool, prompt and output tokens
        self.state = self.grammar.initial_state if self.grammar is not None else None
        self._synced = 0                            # output tokens absorbed into the state

    def ready(self) -> bool:
        """Whether the grammar, if any, is compiled (raises its compile's error)."""
        if self.compiling is None:
            return True
        if not self.compiling.done():
            return False
        self.grammar = self.compiling.result()
        self.state, self.compiling = self.grammar.initial_state, None
        return True

    def sync(self, token_ids: list[int], device) -> None:
        """Absorb the output tokens emitted since the last call (`token_ids`: prompt + output)."""
        if self.counts is None:
            self.counts = torch.zeros(self.vocab_size, device=device)
            self.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=device)
            if self.repetition != 1.0:
                self.seen[torch.tensor(token_ids[:self.num_prompt], device=device)] = True
        new = token_ids[self.num_prompt + self._synced:]
        if not new:
            return
        ids = torch.tensor(new, dtype=torch.long, device=device)
        self.counts.index_add_(0, ids, torch.ones(len(new), device=device))
        self.seen[ids] = True
        if self.grammar is not None:
            for t in new:
                self.state = self.grammar.advance(self.state, t)
        self._synced += len(new)

    def grammar_state(self, drafted: list[int]) -> int | None:
        """The grammar's state after the output so far and then `drafted`."""
        state = self.state
        for t in drafted:
            state = self.grammar.advance(state, t)
        return state

    def complete(self, token_ids: list[int]) -> bool:
        """The grammar is satisfied by the output `token_ids[num_prompt:]` and allows nothing
        more (or its eos was emitted): the request ends with `stop`."""
        if self.grammar is None:
            return False
        out = token_ids[self.num_prompt:]
        if out and out[-1] == self.grammar.eos_token_id:
            return True
        state = self.state
        for t in out[self._synced:]:
            state = self.grammar.advance(state, t)
        return self.grammar.complete(state)

    def apply(self, row: torch.Tensor, drafted: list[int]) -> torch.Tensor:
        """[vocab_size] float logits of the position after the output so far plus `drafted`."""
        extra = torch.tensor(drafted, dtype=torch.long, device=row.device)
        if self.repetition != 1.0:
            seen = self.seen.clone()
            seen[extra] = True
            scaled = torch.where(row > 0, row / self.repetition, row * self.repetition)
            row = torch.where(seen, scaled, row)
        if self.presence or self.frequency:
            counts = self.counts.index_add(0, extra, torch.ones(len(drafted), device=row.device))
            row = row - counts * self.frequency - (counts > 0).float() * self.presence
        if len(self.bias_ids):
            row = row.index_add(0, self.bias_ids.to(row.device), self.bias_values.to(row.device))
        if self.grammar is not None:
            allowed = self.grammar.allowed(self.grammar_state(drafted), row.device)
            masked = torch.full_like(row, float("-inf"))
            masked[allowed] = row[allowed]
            row = masked
        return row


class Processors:
    """The engine's factory of `RequestProcessor`s: checks a request's processing against the
    served vocabulary and compiles its grammar with the served tokenizer."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids,
                 grammar_cache_dir: str | None = None):
        self.vocab_size = vocab_size
        # a checkpoint without a tokenizer (random benchmark weights) serves token ids alone
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            eos = min(eos_token_ids, default=0)
        self.grammars = GrammarCompiler(tokenizer, eos, grammar_cache_dir)
        self.compiling: list = []       # sequences admitted once their grammar is compiled

    def build(self, params, num_prompt: int) -> RequestProcessor | None:
        """None when the request asks for no processing (its rows are never touched)."""
        if not params.processes_logits:
            return None
        if any(t >= self.vocab_size for t, _ in params.logit_bias):
            raise InvalidParamError(f"logit_bias: token ids must be below the vocabulary size "
                                    f"{self.vocab_size}", "logit_bias")
        grammar = None
        if params.json_schema is not None:
            if self.grammars.tokenizer is None:
                raise InvalidParamError("response_format: the served model has no tokenizer, "
                                        "and JSON output is compiled against one",
                                        "response_format")
            try:
                grammar = self.grammars.compile_later(params.json_schema)
                if isinstance(grammar, Future) and grammar.done() and grammar.exception():
                    raise grammar.exception()
            except GrammarError as exc:
                raise InvalidParamError(f"response_format: {exc}", "response_format") from None
        return RequestProcessor(params, num_prompt, self.vocab_size, grammar)

    def admit(self, add, idle: bool) -> list:
        """Pass each sequence in `compiling` whose grammar is now compiled to `add`; returns
        [(sequence, error)] for those whose compile failed. Aborted ones are dropped.
        idle: nothing else can step, so wait up to 50 ms for a compile instead of spinning."""
        if not self.compiling:
            return []
        if idle:
            wait([seq.processor.compiling for seq in self.compiling], timeout=0.05,
                 return_when=FIRST_COMPLETED)
        failed, still = [], []
        for seq in self.compiling:
            if seq.status == Status.FINISHED:
                continue
            try:
                (add if seq.processor.ready() else still.append)(seq)
            except Exception as exc:
                failed.append((seq, exc))
        self.compiling = still
        return failed


def process(logits: torch.Tensor, rows: list) -> torch.Tensor:
    """[num_rows, vocab_size] logits -> the same, processed (float32) where a row asks for it.

    rows[r] = (seq, drafted): the sequence row r belongs to and the tokens drafted before its
    position in this step. Returns `logits` itself when no row's sequence has a processor (those
    requests pay nothing); never writes into `logits`.
    """
    todo = [r for r, (seq, _) in enumerate(rows) if seq.processor is not None]
    if not todo:
        return logits
    out = logits.to(torch.float32, copy=True)
    synced = set()
    for r in todo:
        seq, drafted = rows[r]
        proc = seq.processor
        if id(seq) not in synced:
            proc.sync(seq.token_ids, out.device)
            synced.add(id(seq))
        out[r] = proc.apply(out[r], drafted)
    return out
