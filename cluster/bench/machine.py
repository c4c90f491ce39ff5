"""Which machine a benchmark ran on, written into its JSON: figures differ by CPU model and by
the instruction sets that decide the engine's kernels and dtype (docs/benchmarks.md states the
CPU of every table)."""

from __future__ import annotations

import os
import platform
import time

# the instruction sets that change what the CPU path runs (decisions 0003 and 0004)
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_model(cpuinfo: str | None = None) -> tuple[str, list[str]]:
    """(model name, the ISA_FLAGS it has) from /proc/cpuinfo's first processor; where there is
    no /proc/cpuinfo, platform's name and no flags."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return platform.processor() or platform.machine(), []
    fields = dict(line.split(":", 1) for line in cpuinfo.split("\n\n")[0].splitlines()
                  if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    name = fields.get("model name") or platform.processor() or platform.machine()
    return name, [f for f in ISA_FLAGS if f in flags]


def describe(**extra) -> dict:
    """The host, its CPU model and flags, its cores, the load average now and the UTC time."""
    name, flags = cpu_model()
    return {"host": platform.node(), "cpu": name, "cpu_flags": flags, "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **extra}
