"""`specserve bench engine --peer vllm`: the sweep's prompts through vLLM in a child process.

vLLM runs in ANOTHER interpreter (`--peer-python`, its own venv; never a dependency of this
project), with the same prompts, new tokens, threads and temperature (greedy by default), eos
ignored. Its runs are interleaved with ours, one at a time (never at the same time): for each
batch and repeat, our baseline and adaptive runs, then vLLM's baseline and speculative runs.
A small shared machine's speed drifts by tens of percent within minutes, so a sweep of ours
followed by a sweep of vLLM's would compare two different machines.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

CHILD = Path(__file__).with_name("peer_vllm.py")
# After a vLLM run its OpenMP threads spin before they sleep (Intel OpenMP: 200 ms by default);
# the next run, ours, waits that out rather than share the cores with them.
IDLE_S = 0.3


class Peer:
    """vLLM children (one per `--peer-dtype`), each holding a baseline and a speculative `LLM`,
    started once; `run(batch)` times one batch through every child in turn."""

    def __init__(self, args, prompts, batches):
        from cluster.bench.peer_vllm import READY, env_for

        if not args.peer_python:
            raise SystemExit("--peer vllm needs --peer-python (an interpreter that imports vllm)")
        fam = Path(args.family).resolve()
        self.batches, self.children, self.runs, self.version = batches, {}, {}, None
        self._tmp = tempfile.TemporaryDirectory()
        self.settings = {"target": str(fam / "target"), "draft": str(fam / "draft"),
                         "batches": batches, "new_tokens": args.new_tokens, "threads": args.threads,
                         "temperature": getattr(args, "temperature", 0.0),
                         "device": args.device, "num_spec": args.peer_spec_tokens,
                         "repeats": max(1, getattr(args, "repeats", 1)), "interleaved": True}
        dtypes = [d.strip() for d in args.peer_dtype.split(",") if d.strip()]
        if not dtypes:
            raise SystemExit("--peer-dtype needs at least one dtype (e.g. bfloat16)")
        for dtype in dtypes:
            job_path = Path(self._tmp.name) / f"job-{dtype}.json"
            job_path.write_text(json.dumps({**self.settings, "prompts": prompts, "dtype": dtype}))
            self.children[dtype] = subprocess.Popen(
                [args.peer_python, str(CHILD), str(job_path)],
                env=env_for(args.peer_python, args.threads), cwd=self._tmp.name,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.version = json.loads(self._answer(dtype, READY))["version"]
            self.runs[dtype] = {"baseline": {}, "speculative": {}}

    def _answer(self, dtype: str, tag: str) -> str:
        """The payload of the child's next `tag` line (its log lines skipped, their tail kept)."""
        child, tail = self.children[dtype], deque(maxlen=60)
        for line in child.stdout:
            if line.startswith(tag + " "):
                return line[len(tag) + 1:]
            tail.append(line)
        print("".join(tail), file=sys.stderr)
        self.close()
        raise SystemExit(f"the vLLM peer failed (exit {child.wait()}, dtype {dtype})")

    def run(self, batch: int) -> None:
        from cluster.bench.peer_vllm import RESULT

        for dtype, child in self.children.items():
            child.stdin.write(json.dumps({"batch": batch}) + "\n")
            child.stdin.flush()
            out = json.loads(self._answer(dtype, RESULT))
            time.sleep(IDLE_S)
            for name, tok_s in out.items():
                self.runs[dtype][name].setdefault(str(batch), []).append(tok_s)
                print(f"vllm {name} ({dtype}) batch {batch}: {tok_s:.1f} tok/s", file=sys.stderr)

    def result(self) -> dict:
        """Medians per dtype, batch and configuration, as ours are reported; the faster dtype's
        figure per cell (`best_of`)."""
        by_dtype = {dtype: {"version": self.version, "runs": runs,
                            **{name: {b: statistics.median(v) for b, v in per.items()}
                               for name, per in runs.items()}}
                    for dtype, runs in self.runs.items()}
        result = best_of(by_dtype, self.batches)
        result["settings"] = {**{k: v for k, v in self.settings.items()
                                 if k not in ("target", "draft")}, "dtypes": list(by_dtype)}
        return result

    def close(self) -> None:
        for child in self.children.values():
            if child.stdin and not child.stdin.closed:
                child.stdin.close()
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()
        self._tmp.cleanup()


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
