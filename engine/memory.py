"""The KV byte budget of a replica: device memory minus weights minus a reserve.

On a GPU the budget is what is free after the weights are loaded, less the activation reserve.
On a CPU there is no device to fill, so the budget is a quarter of the available RAM, capped at
2 GiB (the demo family's 32 sequences of 2,048 tokens need far less); pass `kv_budget_bytes`
to choose it exactly.
"""

from __future__ import annotations

import os

import torch

CPU_CAP = 2 << 30


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_budget_bytes(config, weight_bytes: int) -> int:
    """config: EngineConfig; weight_bytes: already loaded (so not free any more on a GPU)."""
    device = torch.device(config.device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = free - config.memory_reserve_bytes
    else:
        budget = min(CPU_CAP, available_ram_bytes() // 4 - config.memory_reserve_bytes)
    if budget <= 0:
        raise MemoryError(f"no memory left for the KV cache on {device} after {weight_bytes} "
                          f"bytes of weights and a {config.memory_reserve_bytes}-byte reserve")
    return int(budget)
