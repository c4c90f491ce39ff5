"""Token-level inference: sequences, KV budgets, the continuous-batching scheduler, speculative
steps, rejection sampling and metrics. Imports torch and `models/`; never Ray or the serving side.

Kept free of imports on purpose: `engine.cost_model` is pure Python and is imported by the policy
and the simulator without pulling torch.
"""

import os
import time

# How idle OpenMP threads wait, chosen before torch loads OpenMP (libgomp reads it once).
# Measured on this project's 2-core machine, reference-py, 2 threads, one decode step:
# - cores shared with busy processes: spinning threads stall the step 6-30x (batch 4: 138-583 ms
#   against 19-22 ms sleeping, load average ~11 on 2 cores), so they must sleep (PASSIVE);
# - cores free: sleeping costs a futex wake-up per parallel region, ~500 regions a step; a
#   bounded spin (SPIN_COUNT iterations, well under a millisecond, then sleep) made the step
#   1.2-1.5x faster (batch 1: 18-20 -> 11-16 ms; batch 32: 67-76 -> 45-62 ms).
# So: spin briefly when the cores are free when the process starts (sampled over 50 ms), sleep
# when they are not.
# OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment always win. Ray replicas sharing a node's
# cores get PASSIVE from their runtime environment (deployments/app.py).
SPIN_COUNT = 100_000
# A tier's `openmp_wait: brief` (Serve replicas): spin this long (tens of microseconds) then
# sleep. The gaps between one forward's parallel regions are shorter, so a step runs at nearly
# the spinning speed, and an idle replica sleeps at once. Measured (reference-py, bf16, 2
# threads, fused attention, quiet machine): decode step at batch 4 / 32: 9.8 / 18.8 ms passive,
# 4.4 / 14.0 brief, 4.5 / 13.5 spin (100,000), 5.7 / 17.8 at 1,000.
BRIEF_SPIN_COUNT = 10_000
OMP_DEFAULTED: dict[str, str] = {}


def _busy_cores(cores: int, sample_s: float = 0.05) -> float:
    """Cores busy right now: from /proc/stat over `sample_s` (the load average lags a minute
    behind, long enough to pick the wrong policy), else the 1-minute load average."""
    def read():
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return ticks[3] + ticks[4], sum(ticks)          # idle + iowait, all
    try:
        idle0, total0 = read()
        time.sleep(sample_s)
        idle1, total1 = read()
        machine = os.cpu_count() or cores
        return machine * (1 - (idle1 - idle0) / max(1, total1 - total0)) * cores / machine
    except (OSError, ValueError, IndexError):
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else float(cores)


def _choose_openmp_wait() -> None:
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if _busy_cores(cores) + 0.5 < cores:
        OMP_DEFAULTED["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    else:
        OMP_DEFAULTED["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.update(OMP_DEFAULTED)


_choose_openmp_wait()
