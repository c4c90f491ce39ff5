"""Token-level inference: sequences, KV budgets, the continuous-batching scheduler, speculative
steps, rejection sampling and metrics. Imports torch and `models/`; never Ray or the serving side.

Kept free of imports on purpose: `engine.step_cost`, `engine.calibration` and `engine.k_rule` are
pure Python and are imported by the policy and the simulator without pulling torch.
"""

import os
import time

# How idle OpenMP threads wait, chosen before torch loads OpenMP (libgomp reads it once):
# - cores shared with busy processes: spinning threads steal the cores the step needs, so they
#   must sleep (PASSIVE);
# - cores free: sleeping costs a futex wake-up per parallel region, ~500 regions a step, so a
#   bounded spin (SPIN_COUNT iterations, well under a millisecond, then sleep) is faster.
# So: spin briefly when the cores are free when the process starts (sampled over 50 ms), sleep
# when they are not (figures: docs/decisions/0006-openmp-wait-policy.md).
# OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment always win. Ray replicas sharing a node's
# cores get PASSIVE from their runtime environment (deployments/app.py).
SPIN_COUNT = 100_000
# A tier's `openmp_wait: brief` (Serve replicas): spin this long (tens of microseconds) then
# sleep. The gaps between one forward's parallel regions are shorter, so a step runs at nearly
# the spinning speed, and an idle replica sleeps at once (docs/decisions/0006-openmp-wait-policy.md).
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
