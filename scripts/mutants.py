"""Mutation check: break the engine one named line at a time and see whether its tests notice.

Each mutant replaces one exact snippet of one file (found exactly once) and names the tests that
should go red. The script copies the checkout (the files git knows of: tracked, plus untracked
ones not ignored) into a scratch folder, runs those tests there once unmutated (they must
pass), then for each mutant applies it, runs its tests with `pytest -x -q` under this Python,
and restores the file. It prints per mutant:

  caught        a selected test failed (or the run errored on import, or timed out);
  survived      every selected test passed with the breakage in place;
  broken-patch  the snippet is not in the file exactly once: the list is out of date (an error).

Exit status: 0 when every mutant was caught, 1 when one survived, errored or is a broken patch,
2 when the tests fail unmutated. Not part of `make test`; docs/testing.md says
how to run it and how to add a mutant. Usage:

  .venv/bin/python scripts/mutants.py [--list] [--only NAME ...] [--jobs N] [--timeout S]
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str                 # relative to the checkout
    original: str             # exact text, present exactly once in the file
    replacement: str
    tests: tuple[str, ...]    # pytest paths or node ids, relative to the checkout, one folder
    breaks: str               # what the breakage does, in a sentence


T = "tests/engine/"     # most selections are engine tests

MUTANTS = [
    # ---- the four behaviours of issue 47, and the prefill_mode="alone" fix -------------------
    Mutant("spec-count-past-stop", "engine/llm_engine.py",
           "seq.num_speculative_output += len(new)",
           "seq.num_speculative_output += len(r.tokens)",
           (T + "test_billing_counts.py::test_a_stop_inside_a_step_counts_only_the_tokens_kept",),
           "tokens a step emits past a stop token count as speculative output (billed)"),
    Mutant("trials-count-all-drafts", "engine/llm_engine.py",
           "trials = r.accepted + (r.accepted < it.k)", "trials = it.k",
           (T + "test_acceptance.py::"
            "test_the_engine_estimate_pools_its_steps_accepted_and_tried_counts",),
           "drafts after the first rejection count as trials: the live estimate runs low"),
    Mutant("swap-keeps-estimate", "engine/llm_engine.py",
           "        self.acceptance.reset()\n", "",
           (T + "test_draft_swap.py::test_swap_restarts_the_acceptance_estimate_from_the_prior",),
           "a new draft inherits the old draft's acceptance estimate"),
    Mutant("k-ignores-max-tokens", "engine/scheduler.py",
           "s.params.max_tokens - s.num_output - 1)) if s.speculative else 0",
           "s.options.k_max)) if s.speculative else 0",
           (T + "test_scheduler.py::test_k_is_capped_by_the_tokens_a_request_may_still_emit",),
           "k is not capped by the tokens a request may still emit: wasted drafts and KV"),
    Mutant("alone-victim-without-item", "engine/scheduler.py",
           "bool((id(s) in items and items[id(s)].k)",
           "bool((items[id(s)].k)",
           (T + "test_scheduler.py::test_prompts_alone_make_room_under_memory_pressure",),
           "a step of prompts alone under memory pressure raises KeyError (decoders sit out)"),
    Mutant("alone-preempt-without-item", "engine/scheduler.py",
           "items.pop(id(victim), None)", "del items[id(victim)]",
           (T + "test_scheduler.py::test_prompts_alone_make_room_under_memory_pressure",),
           "preempting a decoder that sits out a step of prompts alone raises KeyError"),
    # ---- the rejection rule -----------------------------------------------------------------
    Mutant("accept-ratio-inverted", "engine/rejection_sampler.py",
           "uniform * q < p)", "uniform * p < q)",
           (T + "test_rejection_sampler.py",),
           "a draft token is accepted with probability min(1, q/p) instead of min(1, p/q)"),
    Mutant("recovered-from-p", "engine/rejection_sampler.py",
           "residual = (weights - draft_probs[draft_row]).clamp_(min=0.0)",
           "residual = weights.clamp(min=0.0)",
           (T + "test_rejection_sampler.py",),
           "the recovered token is drawn from p instead of normalise(max(0, p - q))"),
    Mutant("accepts-after-rejection", "engine/rejection_sampler.py",
           "num_accepted = padded.cumprod(dim=1).sum(dim=1)",
           "num_accepted = padded.sum(dim=1)",
           (T + "test_rejection_sampler.py",),
           "drafts that agree after the first rejection are accepted too"),
    Mutant("final-row-skips-bonus-rows", "engine/rejection_sampler.py",
           "final_row = cu_target + num_accepted", "final_row = cu_draft + num_accepted",
           (T + "test_rejection_sampler.py::test_greedy_accepts_while_argmax_agrees",),
           "the recovered/bonus token is read from the wrong sequence's target row"),
    Mutant("residual-for-the-bonus-token", "engine/rejection_sampler.py",
           "use = (num_accepted < k) &", "use = (num_accepted <= k) &",
           (T + "test_rejection_sampler.py",),
           "a sequence whose drafts were all accepted draws its bonus token from the residual"),
    # ---- drafts on the device (decision 0038) -----------------------------------------------
    Mutant("drafts-round-major", "engine/spec_decode.py",
           "flat_ids = torch.cat(rounds)[perm]", "flat_ids = torch.cat(rounds)",
           (T + "test_host_syncs.py::test_drafts_fed_on_the_device_reach_their_own_rows",),
           "the flat drafts reach the verify forward round after round, not item after item"),
    Mutant("round-feeds-first-tokens", "engine/spec_decode.py",
           "[prev_active.index(i) for i in active]", "list(range(len(active)))",
           (T + "test_host_syncs.py::test_drafts_fed_on_the_device_reach_their_own_rows",),
           "a round after a request stopped drafting feeds the first requests' tokens"),
    Mutant("draft-read-each-round", "engine/spec_decode.py",
           "        rounds.append(tokens)\n", "        rounds.append(tokens)\n        tokens.tolist()\n",
           (T + "test_host_syncs.py::test_a_decode_step_reads_the_device_once",),
           "a draft round's tokens come back to the host"),
    # ---- CUDA graphs' padded forward (decision 0039) ------------------------------------------
    Mutant("padding-kv-into-block-0", "engine/attention.py",
           "slots.copy_(upload([blocks + [pad[1]] * extra,", "slots.copy_(upload([blocks + [0] * extra,",
           (T + "test_cuda_graphs.py",),
           "padding tokens write their KV into block 0, which a sequence may hold"),
    Mutant("padding-rows-over-row-0", "engine/flex_attention.py",
           "torch.full((kept - rows.numel(),), pad_row)", "torch.full((kept - rows.numel(),), 0)",
           (T + "test_cuda_graphs.py",),
           "the pads of a padded FlexAttention call overwrite the first real row of the output"),
    Mutant("scratch-block-still-free", "engine/kv_cache.py",
           "        self._free[block] = 0\n        self.num_empty -= 1\n", "",
           (T + "test_cuda_graphs.py::test_the_scratch_block_is_reserved_for_good",),
           "the graphs' scratch block can be handed to a sequence"),
    Mutant("rank-without-graphs", "engine/tp_worker.py",
           "max_batch=self.max_num_seqs, graphs=graphs)", "max_batch=self.max_num_seqs)",
           (T + "test_tensor_parallel.py::test_tp2_matches_tp1_and_transformers"
            "[odd_shape-flex-static]",),
           "a tensor-parallel rank runs rank 0's padded forwards unpadded"),
    Mutant("rank-pool-without-scratch", "engine/llm_engine.py",
           "pool.pool.shape[1],  # + scratch", "pool.num_blocks,",
           (T + "test_tensor_parallel.py::test_tp2_matches_tp1_and_transformers"
            "[odd_shape-flex-static]",),
           "the other ranks' pools lack the scratch block rank 0 reserved"),
    Mutant("rank-ids-read-on-the-host", "engine/model_runner.py",
           "            if isinstance(input_ids, torch.Tensor):      # on the device: sent",
           "            if isinstance(input_ids, torch.Tensor):\n"
           "                input_ids = input_ids.tolist()\n"
           "            if isinstance(input_ids, torch.Tensor):      # on the device: sent",
           (T + "test_host_syncs.py::test_a_tensor_parallel_step_reads_the_device_once",),
           "rank 0 reads the drafts back to put them in the rank message"),
    Mutant("cuda-piece-mask-from-the-top", "engine/attention.py",
           "return causal_lower_right(stop - pos, stop)",
           "return torch.nn.attention.bias.causal_upper_left(stop - pos, stop)",
           (T + "test_attention.py::test_the_cuda_form_of_a_pieces_mask_is_the_boolean_one",),
           "on CUDA a prompt piece's query i sees keys 0..i instead of 0..pos + i"),
    Mutant("piece-mask-hides-the-diagonal", "engine/attention.py",
           "            <= torch.arange(pos, stop, device=device)[:, None])",
           "            < torch.arange(pos, stop, device=device)[:, None])",
           (T + "test_attention.py::test_prompt_pieces_equal_per_sequence",),
           "a prompt piece's query does not see its own key"),
    Mutant("profile-all-reduce-over-the-group", "engine/memory.py",
           "all_reduce, engine.target_fw.all_reduce = engine.target_fw.all_reduce, lambda x: x",
           "all_reduce = engine.target_fw.all_reduce",
           (T + "test_tensor_parallel.py::test_rank_0_runs_the_memory_plans_forwards_alone",),
           "the memory plan's forward waits in an all-reduce the other ranks never join"),
    Mutant("profile-all-reduce-left-skipped", "engine/memory.py",
           "        engine.target_fw.all_reduce = all_reduce\n", "        pass\n",
           (T + "test_tensor_parallel.py::test_rank_0_runs_the_memory_plans_forwards_alone",),
           "rank 0 serves without its all-reduces after the memory plan's forward"),
    Mutant("warm-up-keeps-its-blocks", "engine/model_runner.py",
           "            pool.free(blocks, owner)\n", "",
           (T + "test_cuda_graphs.py::test_warm_up_runs_every_bucket_twice_and_gives_its_blocks_back",),
           "the start-up graph warm-up leaves its blocks allocated"),
    Mutant("warm-up-runs-once", "engine/model_runner.py",
           "            for _ in range(2):                   # eager",
           "            for _ in range(1):                   # eager",
           (T + "test_cuda_graphs.py::test_warm_up_runs_every_bucket_twice_and_gives_its_blocks_back",),
           "the warm-up compiles each bucket but captures none: captures stall serving"),
    # ---- KV accounting: rollback, frees, the budget -----------------------------------------
    Mutant("rollback-keeps-rejected-kv", "engine/llm_engine.py",
           "seq.num_computed = old_len + r.accepted", "seq.num_computed = old_len + it.k",
           (T + "test_greedy.py::test_speculative_equals_plain_decoding_in_each_dtype"
            "[float32-fused]",),
           "the target's KV of rejected drafts is kept as if it held accepted tokens"),
    Mutant("draft-rollback-one-past", "engine/llm_engine.py",
           "seq.draft_computed = old_len + min(r.accepted, it.k - 1)",
           "seq.draft_computed = old_len + r.accepted",
           (T + "test_spec_invariants.py::"
            "test_the_target_as_its_own_draft_has_every_draft_accepted",),
           "after all k accepted, the draft claims KV for its last token, which it never fed"),
    Mutant("free-leaks-a-block", "engine/kv_cache.py",
           "            if not self.cache.release(b):\n                self._free[b] = 1",
           "            if not self.cache.release(b) and b != blocks[-1]:\n                self._free[b] = 1",
           (T + "test_memory.py::test_admission_waits_for_room_and_aborts_free_at_once",),
           "every free returns one block fewer to the pool than it frees"),
    Mutant("preempt-keeps-kv", "engine/scheduler.py",
           "    def _preempt(self, seq: Sequence) -> None:\n        self._free_all(seq)",
           "    def _preempt(self, seq: Sequence) -> None:\n"
           "        seq.blocks, seq.draft_blocks = [], []",
           (T + "test_memory.py::test_random_arrivals_and_aborts_stay_within_budget",),
           "a preempted sequence's blocks are dropped without being freed (leak)"),
    Mutant("downgrade-keeps-draft-kv", "engine/scheduler.py",
           "        seq.mode = Mode.BASELINE\n        self._free_draft(seq)",
           "        seq.mode = Mode.BASELINE",
           (T + "test_spec_invariants.py::test_dropping_speculation_frees_the_draft_kv",),
           "dropping speculation keeps the draft's KV blocks"),
    Mutant("trim-keeps-rejected-blocks", "engine/scheduler.py",
           "keep = blocks_needed(len(seq.token_ids), self.tpb)",
           "keep = blocks_needed(len(seq.token_ids), self.tpb) + 1",
           (T + "test_spec_invariants.py::"
            "test_rejected_drafts_blocks_are_trimmed_after_each_step",),
           "a block past the kept tokens (rejected drafts' slots) stays allocated"),
    Mutant("need-ignores-drafts", "engine/scheduler.py",
           "blocks_needed(s.num_computed + item.num_feed + item.k, self.tpb)",
           "blocks_needed(s.num_computed + item.num_feed, self.tpb)",
           (T + "test_spec_invariants.py::"
            "test_rejected_drafts_blocks_are_trimmed_after_each_step",),
           "no target blocks are allocated for the k draft tokens the verify forward writes"),
    Mutant("budget-overdrawn-by-one", "engine/scheduler.py",
           "while sum(sum(self._need(it)) for it in items.values()) > self.pool.num_free:",
           "while sum(sum(self._need(it)) for it in items.values()) > self.pool.num_free + 1:",
           (T + "test_memory.py::test_random_arrivals_and_aborts_stay_within_budget",),
           "a step may need one block more than is free before anything is dropped"),
    # ---- the coupled sampler ----------------------------------------------------------------
    Mutant("noise-exponential", "engine/coupled_sampler.py",
           "return u.log_().neg_().log_().neg_()", "return u.log_().neg_()",
           (T + "test_coupled_sampler.py::test_plain_coupled_sample_follows_p",),
           "the noise is Exp(1), not Gumbel: argmax(log p + noise) no longer follows p"),
    Mutant("coupled-on-probs", "engine/coupled_sampler.py",
           "return (probs.double().log() + g).argmax(dim=-1)",
           "return (probs.double() + g).argmax(dim=-1)",
           (T + "test_coupled_sampler.py::test_plain_coupled_sample_follows_p",),
           "the noise is added to probabilities instead of log-probabilities"),
    Mutant("noise-ignores-position", "engine/coupled_sampler.py",
           "return _hash32(h ^ _hash32(_mul32(pos, 0x7F4A7C15) ^ 0x3C6EF372))",
           "return _hash32(h)",
           (T + "test_coupled_sampler.py::test_consecutive_positions_are_independent",),
           "every position of a seeded request gets the same noise"),
    Mutant("draft-noise-next-position", "engine/spec_decode.py",
           "[len(items[i].seq.token_ids) + j for i in active]",
           "[len(items[i].seq.token_ids) + j + 1 for i in active]",
           (T + "test_seeded.py::test_fixed_k_equals_plain",),
           "the draft proposes with the next position's noise: seeded acceptance collapses"),
    Mutant("seeded-rows-rejection-rule", "engine/spec_decode.py",
           "rule_greedy = [it.seq.params.greedy or s is not None for",
           "rule_greedy = [it.seq.params.greedy or False for",
           (T + "test_seeded.py::test_fixed_k_equals_plain",),
           "seeded rows go through rejection sampling: their text depends on k"),
    # ---- logits processing under speculation ------------------------------------------------
    Mutant("verify-rows-ignore-drafts", "engine/spec_decode.py",
           "drafted.get(id(it), [])[:j])", "drafted.get(id(it), [])[:0])",
           (T + "test_logits_processors.py::"
            "test_greedy_speculative_equals_plain_decoding_with_penalties",),
           "the target's verify rows are processed without the drafts before them"),
    Mutant("draft-rows-miss-last-draft", "engine/spec_decode.py",
           "(items[i].seq, drafted[i]) for i in active]",
           "(items[i].seq, drafted[i][:-1]) for i in active]",
           (T + "test_logits_processors.py::"
            "test_the_target_as_its_own_draft_accepts_every_processed_draft",),
           "the draft's round j is processed without the token drafted just before it"),
    Mutant("presence-counts-repeats", "engine/logits_processors.py",
           "(counts > 0).float() * self.presence", "counts * self.presence",
           (T + "test_logits_processors.py::test_rows_follow_the_formula_with_the_drafts_before_them",),
           "the presence penalty is charged per occurrence, like the frequency penalty"),
    Mutant("grammar-state-ignores-drafts", "engine/logits_processors.py",
           "self.grammar.allowed(self.grammar_state(drafted), row.device)",
           "self.grammar.allowed(self.grammar_state([]), row.device)",
           (T + "test_grammar.py::test_a_hundred_sampled_requests_all_match_the_schema",),
           "a row's grammar mask is the state before this step's drafts"),
    Mutant("aborted-while-compiling-runs", "engine/logits_processors.py",
           "            if seq.status == Status.FINISHED:", "            if False:",
           (T + "test_grammar.py::test_a_schema_compiles_while_other_requests_step",),
           "a request aborted while its grammar compiles is scheduled once the grammar is ready"),
    # ---- billing counts ---------------------------------------------------------------------
    Mutant("spec-count-ignores-mode", "engine/llm_engine.py",
           "        if seq.speculative:                   # what ran, for pricing",
           "        if True:                   # what ran, for pricing",
           (T + "test_billing_counts.py::"
            "test_speculative_and_baseline_requests_report_their_split",),
           "baseline requests' tokens count as speculative output"),
    Mutant("rejections-every-step", "engine/sequence.py",
           "self.num_rejections += accepted < k", "self.num_rejections += 1",
           (T + "test_acceptance.py::"
            "test_the_engine_estimate_pools_its_steps_accepted_and_tried_counts",),
           "a request's trials (num_draft_trials, its token acceptance) count a step that "
           "accepted all k as a rejection"),
    Mutant("draft-tokens-are-accepted", "engine/sequence.py",
           "self.num_draft_tokens += k", "self.num_draft_tokens += accepted",
           (T + "test_acceptance.py::"
            "test_the_engine_estimate_pools_its_steps_accepted_and_tried_counts",),
           "a request reports its accepted tokens as its draft tokens (acceptance rate 1)"),
    Mutant("price-speculative-at-baseline", "router/billing.py",
           '+ spec * _rate(prices, "speculative", "completion")',
           '+ spec * _rate(prices, "baseline", "completion")',
           ("tests/router/test_billing.py",),
           "speculative completion tokens are priced at the baseline price"),
    # ---- FlexAttention over the pool in place (decision 0037) --------------------------------
    Mutant("flex-foreign-pages", "engine/flex_attention.py",
           "return (page_of >= 0) & (page_of", "return (page_of * 0 == 0) & (page_of",
           (T + "test_flex_attention.py",),
           "a query row attends pages its sequence does not hold"),
    Mutant("flex-partial-page-as-full", "engine/flex_attention.py",
           "full = (cached + 1) // pp ", "full = (cached + 1) // pp + 1 ",
           (T + "test_flex_attention.py",),
           "a page a row sees in part is listed as seen whole (no mask: future keys read)"),
    Mutant("flex-page-of-chunk", "engine/flex_attention.py",
           "np.arange(c) * pages.num_blocks", "np.arange(c)",
           (T + "test_flex_attention.py",),
           "chunk c of block b is read as page b + c"),
]


def checkout_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, check=True, capture_output=True).stdout
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def copy_checkout(files: list[str], dest: Path) -> None:
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)


def run_tests(where: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, str]:
    """(outcome, the line that says why) for one pytest run in `where`."""
    env = dict(os.environ, PYTHONPATH=str(where), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        return "caught", f"timed out after {timeout:.0f} s"
    lines = [ln for ln in proc.stdout.splitlines() + proc.stderr.splitlines() if ln.strip()]
    why = next((ln for ln in lines if re.match(r"(FAILED|ERROR) \S+\.py", ln)),
               lines[-1] if lines else "")
    if proc.returncode == 0:
        return "survived", why
    if proc.returncode in (1, 2):        # tests failed, or collection failed on the mutant
        return "caught", why
    return "error", f"pytest exit {proc.returncode}: {why}"


def patch_count(m: Mutant) -> int:
    return (ROOT / m.file).read_text().count(m.original)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    p.add_argument("--jobs", type=int, default=1, help="mutants run at once (one copy each)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the unmutated run of the selected tests")
    args = p.parse_args()

    mutants = MUTANTS
    if args.only:
        unknown = set(args.only) - {m.name for m in MUTANTS}
        if unknown:
            p.error(f"unknown mutants: {', '.join(sorted(unknown))} (see --list)")
        mutants = [m for m in MUTANTS if m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name:30} {m.file:28} {m.breaks}\n{'':30} tests: {' '.join(m.tests)}")
        return 0

    broken = [m for m in mutants if patch_count(m) != 1]
    for m in broken:
        print(f"{m.name:30} broken-patch  the snippet is in {m.file} {patch_count(m)} times, "
              f"not once: update the mutant")
    mutants = [m for m in mutants if m not in broken]

    files = checkout_files()
    scratch = Path(tempfile.mkdtemp(prefix="specserve-mutants-"))
    try:
        copies: queue.Queue[Path] = queue.Queue()
        for j in range(max(1, min(args.jobs, len(mutants)))):
            copy_checkout(files, scratch / str(j))
            copies.put(scratch / str(j))
        if not args.no_baseline and mutants:
            # Unmutated, every selected test must pass. One run per test folder: the folders'
            # conftest modules share a name (`from conftest import ...` needs its own first).
            tests = list(dict.fromkeys(t for m in mutants for t in m.tests))
            folders = {}
            for t in tests:
                folders.setdefault(str(Path(t.split("::")[0]).parent), []).append(t)
            start = time.monotonic()
            for group in folders.values():
                outcome, why = run_tests(scratch / "0", tuple(group), args.timeout * 4)
                if outcome != "survived":      # "survived": every selected test passed
                    print(f"baseline: the selected tests fail without any mutant ({why})")
                    return 2
            print(f"baseline: {len(tests)} selections pass unmutated "
                  f"({time.monotonic() - start:.0f} s)")
        lock, results = threading.Lock(), {}

        def one(m: Mutant) -> None:
            where = copies.get()
            path = where / m.file
            text = path.read_text()
            start = time.monotonic()
            try:
                path.write_text(text.replace(m.original, m.replacement, 1))
                outcome, why = run_tests(where, m.tests, args.timeout)
            finally:
                path.write_text(text)
                copies.put(where)
            with lock:
                results[m.name] = outcome
                print(f"{m.name:30} {outcome:9} {time.monotonic() - start:5.0f} s  {why[:110]}",
                      flush=True)

        with ThreadPoolExecutor(max_workers=copies.qsize()) as pool:
            list(pool.map(one, mutants))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    counts = {k: sum(v == k for v in results.values()) for k in ("caught", "survived", "error")}
    print(f"{counts['caught']} caught, {counts['survived']} survived, {counts['error']} errors, "
          f"{len(broken)} broken patches")
    return 0 if not broken and counts["caught"] == len(mutants) else 1


if __name__ == "__main__":
    sys.exit(main())
