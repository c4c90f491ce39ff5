"""The synchronous engine: requests in, one batched step at a time, outputs out.

Owns: building the models, KV pool, scheduler and cost model from an `EngineConfig`; admitting
and aborting requests; running `step()` and turning its tokens into outputs with stop rules.
Does not own: threads or asyncio (`engine/async_engine.py`), nor anything about tiers or HTTP.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from engine.acceptance import (ENGINE_DECAY, ENGINE_PRIOR_TRIALS, SEQ_PRIOR_TRIALS,
                               AcceptanceEstimate, posterior)
from engine.attention import token_major
from engine.calibration import CATCH_UP_MAX, CalibratedCost
from engine.config import EngineConfig
from engine.cuda_graphs import graph_plan
from engine.detokenizer import Detokenizer
from engine.errors import EngineOverloadedError, PromptTooLongError, TPGroupError
from engine.faults import Delays, Faults, FaultyRunner
from engine.drafting import StepDrafting
from engine.grammar import GrammarError
from engine.kv_cache import BlockPool
from engine.logits_processors import Processors
from engine.memory import cpu_kv_budget_bytes, measure_gpu
from engine.metrics import KVPeaks, Metrics, MetricsSnapshot, ServingTimes
from engine.model_runner import ModelRunner
from engine.outputs import EngineStats, RequestOutput
from engine.profiler import load_or_profile
from engine.sampling_params import FinishReason, RequestOptions, SamplingParams
from engine.scheduler import Scheduler, SchedulerLimits
from engine.sequence import Sequence
from engine.spec_decode import StepResult, StepTimes, step
from engine.step_cost import step_parts
from models.cpu_linear import plan_dir
from models.loader import check_compatible, load_served

logger = logging.getLogger(__name__)

DRAFT_UNAVAILABLE = "draft_unavailable"   # RequestOutput.reason: the draft failed, now baseline


class LLMEngine:
    def __init__(self, config: EngineConfig, peers=None):
        self.config = config
        torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        tp = config.tp_size
        if tp > 1 and peers is None:
            raise ValueError("tp_size > 1 needs the other ranks (peers): they take rank 0's KV plan")
        # Rank 0's shard of the target (every rank reads only its own), and the whole draft.
        self.target_model = load_served(config.target, config.dtype, config.device, rank=0,
                                        world=tp, all_reduce=getattr(peers, "all_reduce", None))
        self.tokenizer = self.target_model.tokenizer
        self.draft_model = None
        if config.draft:
            self.draft_model = load_served(config.draft, config.dtype, config.device)
            check_compatible(self.target_model, self.draft_model)
        self.target_fw = self.target_model.forward
        self.draft_fw = self.draft_model.forward if self.draft_model else None
        self.plan_dir = plan_dir(config.row_plan_dir)
        t, d = self.target_fw.shape, self.draft_fw.shape if self.draft_fw else None
        self.max_model_len = config.max_model_len or self.target_model.config.max_position_embeddings
        budget = config.kv_budget_bytes or self._planned_kv_budget()
        self.pool = BlockPool(budget, (t.num_layers, t.num_kv_heads, t.head_dim), config.block_size,
                              self.target_fw.dtype, config.device,
                              (d.num_layers, d.num_kv_heads, d.head_dim) if d else None,
                              resident=config.kv_resident,
                              token_major=token_major(config.device, config.attention))
        pool = self.pool
        # CUDA graphs, (target's, draft's): every rank takes the target's (rank 0's plan)
        self.graph_setup = graph_plan(config.graphs, config.device, config.attention,
                                      dist.get_backend() if peers is not None else None, pool)
        if peers is not None:     # ranks 1..N-1 take this layout; they never re-derive it
            peers.configure_pool(pool.target.tokens_per_block, pool.pool.shape[1],  # + scratch
                                 str(self.target_fw.dtype).removeprefix("torch."),
                                 self.graph_setup[0])
            pool.take_zeroed()    # from here on, the blocks zeroed here are zeroed there too
        self.peers = peers
        self.group_error: TPGroupError | None = None
        self.target = self._runner(self.target_fw, "target", peers, warm=True)
        self.draft = self._runner(self.draft_fw, "draft", warm=True) if self.draft_fw else None
        self.faults, self.delays = (Faults(), Delays()) if config.fault_injection else (None, None)
        if self.faults is not None:
            self.target = FaultyRunner(self.target, self.faults, "target_raise", self.delays,
                                       "target")
            if self.draft is not None:
                self.draft = FaultyRunner(self.draft, self.faults, "draft_raise")
        self.cost = CalibratedCost(load_or_profile(self), draft_excess=True)
        limits = SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                 prefill_mode=config.prefill_mode, prefill_align=config.prefill_align,
                                 prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, limits, self._choose_k, self._acceptance,
                                   self._may_draft)
        self.metrics = Metrics()
        # Engine-wide per-token acceptance a (engine/acceptance.py: decayed pooled counts).
        self.acceptance = AcceptanceEstimate(config.prior_acceptance, ENGINE_PRIOR_TRIALS, ENGINE_DECAY)
        self.drafting = StepDrafting()   # the goodput check, then the k rule and its probe
        self._step_tokens, self._step_drafted = 0, False
        # Where serving time goes: steps against their profile's prices, the loop's time
        # between steps, requests' time in the engine (`EngineStats.serving`).
        self.serving = ServingTimes()
        self.kv_peaks = KVPeaks()
        self.seqs: dict[str, Sequence] = {}
        self.draft_swaps = 0
        self.detok: dict[str, Detokenizer] = {}
        self.processors = Processors(self.tokenizer, self.target_model.vocab_size,
                                     self.target_model.eos_token_ids, config.grammar_cache_dir)

    def _planned_kv_budget(self) -> int:
        """The KV budget from device memory (engine/memory.py): measured and planned on a GPU,
        refused at start with the numbers where one full-length sequence would not fit."""
        if torch.device(self.config.device).type != "cuda":
            return cpu_kv_budget_bytes(self.config)
        plan = measure_gpu(self)
        logger.info("GPU memory plan:\n%s", plan.describe())
        plan.check()
        return plan.kv_budget_bytes

    # ---- adaptive k -------------------------------------------------------------------------
    def _acceptance(self, seq: Sequence) -> float:
        trials = seq.num_accepted + seq.num_rejections
        return posterior(seq.num_accepted, trials, self.global_acceptance, SEQ_PRIOR_TRIALS)

    @property
    def global_acceptance(self) -> float:
        return self.acceptance.value

    def _may_draft(self, batch: int) -> bool:
        return not self.config.adaptive_k or self.drafting.may_draft(self.global_acceptance, batch)

    def _choose_k(self, acceptance: list[float], k_max: list[int], context_tokens: int,
                  extra_tokens: int, catch_up_tokens: list[int] | None = None,
                  tokens_left: list[int] | None = None) -> list[int]:
        if not self.config.adaptive_k:
            return list(k_max)
        return self.drafting.choose_k(self.cost, acceptance, k_max, context_tokens, extra_tokens,
                                      catch_up_tokens, tokens_left)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    options: RequestOptions | None = None) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a SamplingParams")
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
            raise ValueError("prompt token ids must be integers")
        if len(prompt_ids) + 1 > self.max_model_len:
            raise PromptTooLongError(len(prompt_ids), self.max_model_len - 1)
        if not self.scheduler.fits_ever(len(prompt_ids) + 1):
            limit = self.pool.num_blocks * self.pool.target.tokens_per_block - 1
            raise PromptTooLongError(len(prompt_ids), limit, "this replica's KV budget")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineOverloadedError(f"{len(self.scheduler.waiting)} requests are waiting")
        vocab = self.target_model.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        seq = Sequence(request_id, list(prompt_ids), params, options or RequestOptions())
        if params.stop and not seq.options.detokenize:
            raise ValueError("stop strings need detokenize")
        seq.processor = self.processors.build(params, len(prompt_ids))
        self.seqs[request_id] = seq
        self.detok[request_id] = Detokenizer(self.tokenizer if seq.options.detokenize else None,
                                             params.stop)
        if seq.processor is not None and not seq.processor.ready():
            self.processors.compiling.append(seq)     # scheduled once its grammar is compiled
        else:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq, FinishReason.ABORT)
        return self._output(seq, [], final=True)

    def set_delay(self, kind: str, seconds: float) -> None:
        """TEST ONLY (EngineConfig.fault_injection): sleep where a slow device would, see
        engine/faults.py, `Delays`."""
        if self.delays is None:
            raise RuntimeError("fault injection is off (EngineConfig.fault_injection)")
        self.delays.set(kind, seconds)

    def inject_fault(self, kind: str, count: int = 1, after: int = 0) -> None:
        """TEST ONLY (EngineConfig.fault_injection): arm a real fault, see engine/faults.py."""
        if self.faults is None:
            raise RuntimeError("fault injection is off (EngineConfig.fault_injection)")
        if kind == "rank_raise":
            if self.peers is None:
                raise ValueError("rank_raise needs a tensor-parallel target (tp_size > 1)")
            self.peers.inject_fault(count, after)
            return
        self.faults.arm(kind, count, after)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.processors.compiling)

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One batched step. A fault inside it fails only the requests of this step (each gets
        a final output with `error`); the engine goes on serving the others."""
        start = time.perf_counter()
        self.serving.begin(start)
        self._step_tokens, self._step_drafted = 0, False
        self.drafting.begin_step()
        try:
            outputs = self._step(start)
            if self.delays is not None and self._step_drafted:
                self.delays.sleep("drafted_step")
            return outputs
        finally:
            end = time.perf_counter()
            self.drafting.end_step(self._step_tokens, end - start)
            self.serving.end(end, self.scheduler.has_work())

    def _step(self, start: float) -> list[RequestOutput]:
        if self.faults is not None:
            self.faults.fire("engine_crash")
        if self.group_error is not None:
            raise TPGroupError(f"the tensor-parallel group failed earlier: {self.group_error}")
        failed = self.processors.admit(self.scheduler.add, idle=not self.scheduler.has_work())
        items = self.scheduler.schedule()
        # Sequences that outgrew the whole KV pool end with `length` and a final output.
        outputs = [self._output(seq, [], final=True) for seq in self.scheduler.take_truncated()]
        for seq, exc in failed:                       # their grammar did not compile
            outputs += self._fail([seq], exc, "response_format" if isinstance(exc, GrammarError)
                                  else None)
        if not items:
            return outputs
        self.kv_peaks.mark(self.pool.used_by)
        # A draft that catches up on more than a step's worth of tokens (a prompt it has not
        # seen, or many tokens it skipped) prefills inside this step: not a decode step's cost.
        catch_up = max((len(it.seq.token_ids) - it.seq.draft_computed for it in items if it.k > 0),
                       default=0)
        # what the profile prices this step at, as run (ServingTimes)
        priced = step_parts(self.cost.base, [it.k for it in items], len(items),
                            sum(it.num_feed + it.k for it in items),
                            sum(len(it.seq.token_ids) - it.seq.draft_computed for it in items if it.k),
                            sum(len(it.seq.token_ids) for it in items))
        self._step_drafted = any(it.k for it in items)
        try:
            results, times = step(items, self.target, self.draft)
        except TPGroupError as exc:   # the group is out of step: no request may run on it again
            self.group_error = exc
            raise
        except Exception as exc:
            return outputs + self._fail([it.seq for it in items], exc)
        self.metrics.data.num_steps += 1
        self._step_tokens = sum(len(r.tokens) for r in results)
        draft_errors = [r for r in results if r.draft_error is not None]
        if draft_errors:
            self.metrics.data.num_draft_failures += 1
            logger.error("the draft failed; requests %s continue in baseline mode",
                         [r.item.seq.request_id for r in draft_errors],
                         exc_info=draft_errors[0].draft_error)
        for r in results:
            try:
                out = self._apply(r)
            except Exception as exc:
                outputs += self._fail([r.item.seq], exc)
                continue
            if out is not None:
                outputs.append(out)
        seconds = time.perf_counter() - start
        self.serving.stepped(seconds, times.draft_s, priced)
        if catch_up <= CATCH_UP_MAX:
            self._calibrate(items, seconds, times)
        return outputs

    def _fail(self, seqs: list[Sequence], exc: Exception,
              param: str | None = None) -> list[RequestOutput]:
        """End these requests with an error (their KV freed); logged with their ids. With
        `param`, the request's own field was at fault (a schema no token sequence can write):
        a refusal that names it, not an engine failure."""
        message = f"{param}: {exc}"
        if param is None:
            ids = [s.request_id for s in seqs if s.request_id in self.seqs]
            logger.error("engine step failed for requests %s", ids, exc_info=exc)
            self.metrics.data.num_failed_steps += 1
            message = f"the engine failed while running this request ({type(exc).__name__}); it was stopped"
        outputs = []
        for seq in seqs:
            if seq.request_id not in self.seqs:
                continue
            self.scheduler.finish(seq, FinishReason.ERROR)
            del self.seqs[seq.request_id], self.detok[seq.request_id]
            outputs.append(RequestOutput(seq.request_id, "", [], True, FinishReason.ERROR,
                                         seq.num_prompt, seq.num_output, seq.mode,
                                         error=message, error_param=param))
        return outputs

    def _calibrate(self, items, seconds: float, times: StepTimes) -> None:
        """Learn what a decode step costs beyond the profiled forwards.

        The profile times bare forwards at one context; a real step also schedules, samples,
        detokenizes and attends over other contexts. `CalibratedCost(draft_excess=True)` prices
        the draft from its rounds' own time and its tokens' share of the verify forward (both
        timed apart by `step`) and puts what every step costs beyond that and the table on
        every sequence (`engine/calibration.py` says why the draft is not priced per sequence).
        Steps in which a draft caught up on a prompt (a prefill) are not passed here (`step`):
        timed as decode steps, they would price drafting at several times its cost.
        """
        if any(it.num_feed != 1 or it.prefill_align for it in items):   # decode steps only
            return
        self.cost.calibrate([it.k for it in items], sum(len(it.seq.token_ids) for it in items),
                            seconds, could_draft=any(it.seq.speculative for it in items),
                            draft_seconds=times.draft_s, verify_seconds=times.verify_s)

    def _apply(self, r: StepResult) -> RequestOutput | None:
        seq, it = r.item.seq, r.item
        if r.draft_error is not None:         # continue on the target alone, draft KV freed
            self.scheduler.drop_speculation(seq)
            seq.reason = DRAFT_UNAVAILABLE
        if r.prompt_logprobs:
            seq.prompt_logprobs += r.prompt_logprobs
        if not r.tokens:                      # a prefill chunk: KV written, nothing sampled
            seq.num_computed += it.num_feed
            return None
        old_len = len(seq.token_ids)
        seq.num_computed = old_len + r.accepted
        if it.k:
            seq.draft_computed = old_len + min(r.accepted, it.k - 1)
            seq.record_step(it.k, r.accepted)
            trials = r.accepted + (r.accepted < it.k)
            self.acceptance.observe(r.accepted, trials)
        self.metrics.record(it.k, r.accepted, len(r.tokens))
        new, reason = self._append_until_stop(seq, r.tokens)
        if seq.speculative:                   # what ran, for pricing: mode at emission
            seq.num_speculative_output += len(new)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        else:
            self.scheduler.trim(seq)
        return self._output(seq, new, final=reason is not None,
                            logprobs=r.logprobs[:len(new)] if r.logprobs is not None else None,
                            logits=r.logits[:len(new)] if r.logits is not None else None)

    def _append_until_stop(self, seq: Sequence, tokens: list[int]):
        p = seq.params
        eos = set() if p.ignore_eos else set(self.target_model.eos_token_ids)
        stop_ids = eos | set(p.stop_token_ids)
        new = []
        for t in tokens:
            seq.token_ids.append(t)
            new.append(t)
            if t in stop_ids or seq.processor is not None and seq.processor.complete(seq.token_ids):
                return new, FinishReason.STOP        # (complete: the grammar allows nothing more)
            if seq.num_output >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
                return new, FinishReason.LENGTH
        return new, None

    def _output(self, seq: Sequence, new: list[int], final: bool,
                logprobs: list | None = None, logits=None) -> RequestOutput:
        detok = self.detok[seq.request_id]
        prompt_logprobs = None
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        text_ids = [t for t in new if t not in seq.params.stop_token_ids]
        if detok.add(text_ids) and not final:
            self.scheduler.finish(seq, FinishReason.STOP)
            final = True
        if final:
            del self.seqs[seq.request_id], self.detok[seq.request_id]
            self.serving.finished(time.monotonic() - seq.arrival)
        return RequestOutput(seq.request_id, detok.delta(final), new, final, seq.finish_reason,
                             seq.num_prompt, seq.num_output, seq.mode, seq.acceptance_rate,
                             seq.mean_acceptance_length, seq.token_acceptance,
                             len(seq.blocks) * self.pool.block_bytes,
                             len(seq.draft_blocks) * self.pool.block_bytes,
                             num_speculative_tokens=seq.num_speculative_output,
                             num_draft_tokens=seq.num_draft_tokens,
                             num_accepted_tokens=seq.num_accepted,
                             num_draft_trials=seq.num_accepted + seq.num_rejections,
                             reason=seq.reason, logprobs=logprobs,
                             prompt_logprobs=prompt_logprobs, logits=logits)

    # ---- draft swap (between steps) ---------------------------------------------------------
    def load_draft(self, path: str):
        """Load and check a new draft, without touching the running one (slow: do it outside
        the step lock). Refused: another vocabulary or tokenizer, or another KV shape (the pool
        is laid out for the current draft's layers, KV heads and head size)."""
        new = load_served(path, self.config.dtype, self.config.device)
        check_compatible(self.target_model, new)
        forward = new.forward
        forward.build_kernels(self.plan_dir)   # here, not in the swap: it holds the step lock
        old = self.draft_fw.shape if self.draft_fw else None
        s = forward.shape
        if old is None or (s.num_layers, s.num_kv_heads, s.head_dim) != (old.num_layers, old.num_kv_heads, old.head_dim):
            raise ValueError(f"draft {path} has another KV shape ({s.num_layers} layers, {s.num_kv_heads} "
                             f"KV heads of {s.head_dim}) than the running draft: restart the replica")
        return new, forward

    def _runner(self, forward, owner: str, peers=None, warm=False) -> ModelRunner:
        zeroed, c = self.pool.take_zeroed if peers is not None else None, self.config
        runner = ModelRunner(forward, self.pool.layers(getattr(self.pool, owner)), peers,
                             c.attention, zeroed, self.plan_dir, c.max_num_seqs,
                             self.graph_setup[owner == "draft"])
        if warm and self.config.graph_warmup:     # (a swapped draft captures as it runs)
            runner.warm_up(self.pool, owner)
        return runner

    def swap_draft(self, loaded) -> None:
        """Run the next steps with a new draft (from `load_draft`). Every running sequence drops
        its draft KV (computed by the old weights) and re-prefills it when it next drafts; the
        acceptance estimate restarts from the prior. Output stays the target's (lossless)."""
        new, forward = loaded
        self.draft_model, self.draft_fw = new, forward
        self.draft = self._runner(forward, "draft")
        self.scheduler.new_draft(self.draft_swaps + 1)     # cached draft blocks are stale
        for seq in self.seqs.values():
            self.scheduler.reset_draft(seq)
        self.acceptance.reset()
        self.draft_swaps += 1

    # ---- introspection ----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """This engine's load and what the router's policy needs (see `EngineStats`)."""
        s, pool = self.scheduler, self.pool
        measured, per_token = self.metrics.data.acceptance_rate, pool.element_size
        peak_target, peak_draft = self.kv_peaks.peaks(pool.used_by, pool.block_bytes)
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting),
            num_speculative=sum(q.speculative for q in s.running),
            kv_budget_bytes=pool.budget_bytes, kv_used_target_bytes=pool.bytes_used("target"),
            kv_used_draft_bytes=pool.bytes_used("draft"),
            kv_peak_target_bytes=peak_target, kv_peak_draft_bytes=peak_draft,
            target_kv_bytes_per_token=float(pool.target.elems_per_token * per_token),
            draft_kv_bytes_per_token=float(pool.draft.elems_per_token * per_token) if pool.draft else 0.0,
            context_tokens=sum(len(q.token_ids) for q in s.running),
            max_model_len=self.max_model_len, cost=replace(self.cost),
            serving=replace(self.serving),
            acceptance_rate=measured,
            token_acceptance=self.global_acceptance if measured is not None else None,
            speculating_acceptance=tuple(self._acceptance(q) for q in s.running if q.speculative),
            time=time.time(), drafting_pays=self.drafting.goodput.verdict(   # the batch judged
                self.global_acceptance, sum(not q.in_prefill for q in s.running)),
            prefix_cache_queries=s.prefix_queries, prefix_cache_hits=s.prefix_hits,
            draft=str(self.draft_model.path) if self.draft_model is not None else None)

    def snapshot(self) -> MetricsSnapshot:
        s = self.scheduler
        return self.metrics.snapshot(s.num_preemptions, s.num_spec_downgrades)
