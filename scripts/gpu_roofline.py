"""The engine's decode step on one GPU against the roofline, for scripts/gpu_check.sh.

Writes a random bf16 checkpoint of Llama-3-8B's shape (32 layers, hidden 4096, 32/8 heads, MLP
14336, vocab 128256) and a 1B-shaped draft (Llama-3.2-1B: 16 layers, hidden 2048, 32/8 heads,
MLP 8192) with models/synthetic.py, loads them as the engine serves them (sharded loading,
the GPU memory plan), measures the device's copy bandwidth, and times:
- a target decode forward at batch 1/8/32/64/128 and context 1k/4k, against the roofline
  (weight bytes + KV bytes read) / measured copy bandwidth;
- a verify of k + 1 = 5 tokens against a decode at batch 1;
- host synchronisations in each of 12 engine steps of one speculative request (torch's sync
  debug mode), once the sweeps are written;
each with the engine's attention (FlexAttention over the pool in place, compiled: the first
call at a shape builds its kernel, reported as first_call_s; its forwards replayed from CUDA
graphs, captured at a shape's second call), then FlexAttention without graphs, then the gather
+ SDPA fallback on the same pool and weights (ATTENTION=flex+graphs, flex or sdpa runs one
alone; BLOCK_SIZE sets
the engine's block_size, 16 by default: a page caps the decode kernel's key tile).
Prints a table and writes it as JSON to $OUT/roofline-b<tokens per block>.json.
WARMUP=1 instead times the start-up warm-up of every CUDA-graph bucket (`graph_warmup`,
engine/model_runner.py: warm_up) of the target and of the draft, into $OUT/warmup.json.
"""

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.attention import SeqSlice  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from models.synthetic import write_random_llama  # noqa: E402

OUT = Path(os.environ.get("OUT", ROOT / "gpu-check-out"))
WORK = Path(os.environ.get("WORK", "/tmp/specserve-gpu"))
# DRY_RUN=1: the whole script on CPU with tiny random models (eager FlexAttention), so that a
# GPU's minutes are not spent finding a Python error
DRY = os.environ.get("DRY_RUN") == "1"
DEVICE = "cpu" if DRY else "cuda"
BATCHES = (1, 3) if DRY else (1, 8, 32, 64, 128)
CONTEXTS = (40,) if DRY else (1024, 4096)
# (layers, hidden, heads, kv heads, MLP, vocab): Llama-3-8B and Llama-3.2-1B, or tiny
TARGET = (2, 64, 4, 2, 128, 256) if DRY else (32, 4096, 32, 8, 14336, 128256)
DRAFT = (1, 64, 4, 2, 128, 256) if DRY else (16, 2048, 32, 8, 8192, 128256)


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


def copy_bandwidth() -> float:
    """Bytes a second of a device-to-device copy (read + write counted)."""
    src = torch.empty(1 << (20 if DRY else 30), dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync()
    start, n = time.perf_counter(), 20
    for _ in range(n):
        dst.copy_(src)
    sync()
    return 2 * src.numel() * n / (time.perf_counter() - start)


def timed(fn, repeats: int = 10) -> float:
    for _ in range(2):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def sweep(runner, pool, weights, kv_token, bw, label) -> list[dict]:
    """Decode step (and a k = 4 verify at batch 1) of `runner` at every batch and context."""
    rows = []
    for ctx in CONTEXTS:
        for batch in BATCHES:
            per_seq = -(-(ctx + 8) // pool.target.tokens_per_block)
            if per_seq * batch > pool.num_free:
                rows.append({"attention": label, "batch": batch, "context": ctx,
                             "skipped": "KV budget"})
                continue
            tables = [pool.allocate(per_seq, "target") for _ in range(batch)]
            try:
                row = cell(runner, tables, ctx, weights, kv_token, bw)
            except RuntimeError as exc:     # out of memory (the gather's buffers), say: go on
                row = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                if not DRY:
                    torch.cuda.empty_cache()
            finally:
                for t in tables:
                    pool.free(t, "target")
            rows.append({"attention": label, "batch": batch, "context": ctx, **row})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def cell(runner, tables, ctx, weights, kv_token, bw) -> dict:
    batch = len(tables)
    seqs = [SeqSlice(t, ctx, 1) for t in tables]
    start = time.perf_counter()
    runner.run(seqs, [1] * batch, [ctx] * batch, list(range(batch)))
    sync()
    first = time.perf_counter() - start        # the first call builds the kernels
    step = timed(lambda: runner.run(seqs, [1] * batch, [ctx] * batch, list(range(batch))))
    roofline = (weights + batch * ctx * kv_token) / bw
    row = {"step_ms": step * 1e3, "roofline_ms": roofline * 1e3, "ratio": step / roofline,
           "first_call_s": first}
    if batch == 1:
        verify = [SeqSlice(tables[0], ctx, 5)]
        v = timed(lambda: runner.run(verify, [1] * 5, list(range(ctx, ctx + 5)), list(range(5))))
        row["verify5_over_decode"] = v / step
    return row


def warm_up(engine) -> int:
    """Seconds to build and capture every graph bucket at start, the target's then the draft's
    (max_num_seqs 128: 8 batches x 1 or 8 query tokens each), written as each ends."""
    result, out = {"max_num_seqs": engine.config.max_num_seqs}, OUT / "warmup.json"
    for owner, runner in (("target", engine.target), ("draft", engine.draft)):
        start = time.perf_counter()
        buckets = runner.warm_up(engine.pool, owner, modes=("capture", "static"))
        sync()
        result[owner] = {"buckets": buckets, "seconds": time.perf_counter() - start}
        print(owner, result[owner], flush=True)
        out.write_text(json.dumps(result, indent=1))
    return 0


def host_syncs(engine, steps: int = 12) -> dict:
    """Host synchronisations per engine step (torch's sync debug mode counts each one), for one
    speculative request of greedy tokens: the step's own, scheduling and sampling included."""
    import warnings

    from engine.sampling_params import RequestOptions, SamplingParams

    engine.add_request("sync", list(range(1, 200)), SamplingParams(temperature=0, max_tokens=64,
                                                                   ignore_eos=True),
                       RequestOptions("speculative", k_max=4))
    for _ in range(5):                   # prefill, the first kernels built, graphs captured
        engine.step()
    counts = []
    if not DRY:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(steps):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine.step()
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
    finally:
        if not DRY:
            torch.cuda.set_sync_debug_mode(0)
    engine.abort("sync")
    return {"steps": steps, "per_step": counts}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    target, draft = WORK / ("tiny-target" if DRY else "target-8b"), WORK / ("tiny-draft" if DRY else "draft-1b")
    if not (target / "model.safetensors.index.json").exists():
        write_random_llama(target, *TARGET, shards=4, max_position=8192)
    if not (draft / "model.safetensors.index.json").exists():
        write_random_llama(draft, *DRAFT, shards=1, max_position=8192)
    engine = LLMEngine(EngineConfig(str(target), str(draft), dtype="bfloat16", device=DEVICE,
                                    max_num_seqs=128, max_model_len=8192, profile=False,
                                    block_size=int(os.environ.get("BLOCK_SIZE", "16")),
                                    attention="flex" if DRY else "fused",
                                    graphs="static" if DRY else "auto",
                                    kv_budget_bytes=(4 << 20) if DRY else None))
    if os.environ.get("WARMUP"):
        return warm_up(engine)
    bw = copy_bandwidth()
    pool = engine.pool
    weights = engine.target_model.weight_bytes
    kv_token = pool.target.elems_per_token * pool.element_size
    # the engine's own runner (FlexAttention in place, engine/flex_attention.py, its forwards
    # replayed from CUDA graphs, engine/cuda_graphs.py), the same without graphs, then the
    # gather + SDPA fallback over the same pool and weights
    graphed = engine.target.graphs is not None
    runners = {engine.target.backend + ("+graphs" if graphed else ""): engine.target}
    if graphed:
        runners[engine.target.backend] = ModelRunner(engine.target_fw, pool.layers(pool.target),
                                                     attention=engine.target.backend,
                                                     max_batch=128)
    if "sdpa" not in runners:
        runners["sdpa"] = ModelRunner(engine.target_fw, pool.layers(pool.target), attention="sdpa")
    if only := os.environ.get("ATTENTION"):       # flex+graphs, flex or sdpa
        runners = {only: runners[only]}
    rows = []
    result = {"device": "cpu (dry run)" if DRY else torch.cuda.get_device_name(0),
              "copy_bandwidth_Bps": bw,
              "target_weight_bytes": weights, "kv_bytes_per_token": kv_token,
              "tokens_per_block": pool.target.tokens_per_block, "cuda_graphs": graphed,
              "rows": rows}
    out = OUT / f"roofline-b{pool.target.tokens_per_block}.json"
    for label, runner in runners.items():      # written after each part: a timeout keeps them
        rows += sweep(runner, pool, weights, kv_token, bw, label)
        out.write_text(json.dumps(result, indent=1))
    if not os.environ.get("ATTENTION"):      # the engine's step as served
        result["host_syncs"] = host_syncs(engine)
        print("host synchronisations per step:", result["host_syncs"], flush=True)
        out.write_text(json.dumps(result, indent=1))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; target weights {weights / 2**30:.1f} GiB")
    print(f"{'attention':>9} {'batch':>5} {'context':>7} {'step ms':>8} {'roofline ms':>11} "
          f"{'ratio':>6} {'first s':>7}")
    for r in rows:
        if "step_ms" in r:
            print(f"{r['attention']:>9} {r['batch']:>5} {r['context']:>7} {r['step_ms']:>8.2f} "
                  f"{r['roofline_ms']:>11.2f} {r['ratio']:>6.2f} {r['first_call_s']:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
