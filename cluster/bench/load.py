"""`specserve bench load`: what loading a tensor-parallel rank costs in memory, at any shape.

Writes a random Llama checkpoint of the given widths (models/synthetic.py; by default 70B's:
hidden 8192, 64 query and 8 KV heads, MLP 28672, vocab 32000, here with one layer) as several
safetensors files, then loads rank r of `--tp` in one process per rank, all at once, as a
replica's ranks do, and prints each rank's shard and peak resident memory: its growth over
what the process held after importing torch and transformers, and the whole process's peak.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("--dir", default="out/bench-load", help="where the checkpoint is written")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--mlp", type=int, default=28672)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", help="served dtype (the checkpoint is bf16)")
    p.add_argument("--json", default=None, help="write the results here too")


def _load_rank(path: str, rank: int, world: int, dtype: str, out) -> None:
    try:
        _measure_rank(path, rank, world, dtype, out)
    except Exception as exc:                     # the parent prints it instead of a traceback
        out.send({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})


def _measure_rank(path: str, rank: int, world: int, dtype: str, out) -> None:
    import torch

    torch.set_num_threads(1)
    import transformers.models.llama.modeling_llama  # noqa: F401  (a fixed cost, not loading's)

    from engine.tp_worker import peak_resident_bytes, resident_bytes
    from models.loader import load_served

    before = resident_bytes(reset_peak=True)
    start = time.perf_counter()
    model = load_served(path, dtype, "cpu", rank, world, all_reduce=lambda t: t, tokenizer=False)
    out.send({"rank": rank, "shard_bytes": model.weight_bytes, "seconds": time.perf_counter() - start,
              "resident_before": before, "peak": peak_resident_bytes(),
              "growth": peak_resident_bytes() - before})


def run(args) -> int:
    from models.synthetic import write_random_llama

    if args.heads % args.tp or args.kv_heads % args.tp:
        print(f"specserve: --tp {args.tp} must divide --heads {args.heads} and --kv-heads "
              f"{args.kv_heads}")
        return 2
    folder = Path(args.dir) / (f"llama-h{args.hidden}-l{args.layers}-{args.heads}x{args.kv_heads}"
                               f"-mlp{args.mlp}-v{args.vocab}")
    if not (folder / "model.safetensors.index.json").exists():
        print(f"writing {folder} ...", flush=True)
        write_random_llama(folder, args.layers, args.hidden, args.heads, args.kv_heads, args.mlp,
                           args.vocab, args.shards)
    checkpoint = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(args.tp):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_load_rank, args=(str(folder), rank, args.tp, args.dtype, child))
        proc.start()
        child.close()
        pipes.append(parent)
        procs.append(proc)
    rows = [p.recv() for p in pipes]
    for proc in procs:
        proc.join()
    errors = [r for r in rows if "error" in r]
    if errors:
        for r in errors:
            print(f"specserve: rank {r['rank']}: {r['error']}")
        return 2
    mib = 1 << 20
    print(f"checkpoint {checkpoint / mib:.0f} MiB on disk, tp {args.tp}, served {args.dtype}")
    print(f"{'rank':>4} {'shard MiB':>10} {'peak growth MiB':>16} {'growth/shard':>13} "
          f"{'process peak MiB':>17} {'seconds':>8}")
    for r in rows:
        print(f"{r['rank']:>4} {r['shard_bytes'] / mib:>10.0f} {r['growth'] / mib:>16.0f} "
              f"{r['growth'] / r['shard_bytes']:>13.2f} {r['peak'] / mib:>17.0f} {r['seconds']:>8.1f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"checkpoint_bytes": checkpoint, "tp": args.tp,
                                               "dtype": args.dtype, "ranks": rows}, indent=1))
    return 0
