"""`specserve bench engine --peer vllm`: the sweep's prompts through vLLM in a child process.

vLLM runs in ANOTHER interpreter (`--peer-python`, its own venv; never a dependency of this
project), one configuration after the other, after our engine has finished (never at the same
time), with the same prompts, new tokens, threads and greedy decoding with eos ignored.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = Path(__file__).with_name("peer_vllm.py")


def run_peer(args, bench, prompts, batches) -> dict:
    """One child per vLLM dtype; the result keeps each, and `baseline`/`speculative` hold the
    faster dtype's figure per batch (named in `best_dtype`)."""
    from cluster.bench.peer_vllm import env_for

    if not args.peer_python:
        raise SystemExit("--peer vllm needs --peer-python (an interpreter that imports vllm)")
    fam = Path(args.family).resolve()
    by_dtype = {}
    for dtype in [d.strip() for d in args.peer_dtype.split(",") if d.strip()]:
        job = {"target": str(fam / "target"), "draft": str(fam / "draft"), "prompts": prompts,
               "batches": batches, "new_tokens": args.new_tokens, "threads": args.threads,
               "dtype": dtype, "device": args.device, "num_spec": args.peer_spec_tokens,
               "repeats": max(1, getattr(args, "repeats", 1))}
        with tempfile.TemporaryDirectory() as tmp:
            job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
            job_path.write_text(json.dumps(job))
            proc = subprocess.run([args.peer_python, str(CHILD), str(job_path), str(out_path)],
                                  env=env_for(args.peer_python, args.threads), cwd=tmp,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if proc.returncode != 0 or not out_path.exists():
                print(proc.stdout[-4000:], file=sys.stderr)
                raise SystemExit(f"the vLLM peer failed (exit {proc.returncode}, dtype {dtype})")
            by_dtype[dtype] = json.loads(out_path.read_text())
    result = best_of(by_dtype, batches)
    result["settings"] = {k: v for k, v in job.items() if k not in ("prompts", "dtype")}
    result["settings"]["dtypes"] = list(by_dtype)
    return result


def best_of(by_dtype: dict[str, dict], batches: list[int]) -> dict:
    """Per batch and configuration, the faster dtype's figure (and which dtype it was)."""
    result = {"version": next(iter(by_dtype.values()))["version"], "by_dtype": by_dtype,
              "baseline": {}, "speculative": {}, "best_dtype": {"baseline": {}, "speculative": {}}}
    for name in ("baseline", "speculative"):
        for b in map(str, batches):
            dtype = max(by_dtype, key=lambda d: by_dtype[d][name][b])
            result[name][b] = by_dtype[dtype][name][b]
            result["best_dtype"][name][b] = dtype
    return result


def print_side_by_side(sweep: list[dict], peer: dict | None) -> None:
    if peer is None:
        print("\n| batch | baseline | adaptive | adaptive / baseline |")
        print("|---|---|---|---|")
        for r in sweep:
            print(f"| {r['batch']} | {r['baseline_tok_s']:.1f} | {r['adaptive_tok_s']:.1f} | "
                  f"{r['adaptive_tok_s'] / r['baseline_tok_s']:.2f} |")
        return
    spec = peer["settings"]["num_spec"]
    print(f"\noutput tok/s (vLLM {peer['version']}, the faster of {'/'.join(peer['settings']['dtypes'])} "
          f"per cell, draft model {spec} tokens)")
    print("| batch | vLLM baseline | specserve baseline | ratio | vLLM draft spec | "
          "specserve adaptive | ratio | adaptive / our baseline |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sweep:
        vb, vs = peer["baseline"][str(r["batch"])], peer["speculative"][str(r["batch"])]
        db = peer["best_dtype"]["baseline"][str(r["batch"])]
        ds = peer["best_dtype"]["speculative"][str(r["batch"])]
        print(f"| {r['batch']} | {vb:.1f} ({db}) | {r['baseline_tok_s']:.1f} | "
              f"{r['baseline_tok_s'] / vb:.2f} | {vs:.1f} ({ds}) | {r['adaptive_tok_s']:.1f} | "
              f"{r['adaptive_tok_s'] / vs:.2f} | {r['adaptive_tok_s'] / r['baseline_tok_s']:.2f} |")
