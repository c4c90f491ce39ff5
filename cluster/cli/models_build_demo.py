"""`specserve models build-demo`: train the demo family (tokenizer, target, draft, small).

Owns the command line only: arguments, the "up to date" short cut and the printed summary. The
build itself is `models.demo.build_demo_family`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. On a machine whose
# cores are shared, spinning threads stall training whenever another process is busy; sleeping
# costs a little on an idle machine (docs/decisions/0006-openmp-wait-policy.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None,
                        help="family folder (default: $SPECSERVE_DEMO_DIR or ~/.cache/specserve/demo-family)")
    parser.add_argument("--steps-scale", type=float, default=1.0,
                        help="multiply the preset's optimizer steps (the build is budgeted in steps, "
                             "not wall time: a busy machine gives the same family, later)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--preset", choices=("tiny", "cpu", "cuda"), default=None,
                        help="sizes and corpus caps (default: the device's; tiny is for tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="torch CPU threads (default: min(2, cores))")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")


def run(args: argparse.Namespace) -> int:
    from models.demo import DemoSettings, build_demo_family, build_dir, build_lock, is_complete

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()        # per-checkpoint load/save bars; ours stay
    out = (args.out or build_dir()).expanduser()
    preset = args.preset or ("cuda" if args.device == "cuda" else "cpu")
    try:
        settings = DemoSettings(preset=preset, seed=args.seed, steps_scale=args.steps_scale,
                                device=args.device)
    except ValueError as exc:
        print(f"specserve models build-demo: {exc}")
        return 2
    with build_lock(out):
        if not args.force and is_complete(out, settings.hash()):
            print(f"up to date: {out} (settings {settings.hash()})")
            return 0
        if args.force:
            (out / "build_state.json").unlink(missing_ok=True)
        family = build_demo_family(out, settings, threads=args.threads)
    ev = family["eval"]
    print(f"family written to {out} in {family['total_s']:.0f} s")
    for role in ("target", "draft", "small"):
        agree = ev[role].get("acceptance_vs_target", {})
        extra = f", greedy agreement {agree['greedy']:.3f}, t1 {agree['t1']:.3f}" if agree else ""
        print(f"  {role:6s} {family['params'][role] / 1e6:5.2f}M params, held-out CE "
              f"{ev[role]['ce']:.3f}{extra}")
    print(f"  sample: {family['sample']['greedy']!r}")
    return 0
