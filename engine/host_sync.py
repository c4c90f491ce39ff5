"""Moving a step's small tensors between the host and the device without waiting on it.

On a GPU every read of a device value on the host (`tolist`, `item`, `bool`, a boolean mask
index) waits for all the work queued before it, and so does a copy from ordinary host memory
to the device (`torch.tensor(values, device=...)` copies, then synchronises the stream). A
step that does either in the middle of its forwards leaves the GPU idle while the host
catches up, and keeps it from being captured as a CUDA graph. The engine's decode step reads
the device once, at its end (the accepted tokens, `engine/rejection_sampler.py`); everything
sent to the device before that goes through `upload`, and its time is measured by `StepClock`
rather than by waiting (docs/decisions/0038-one-host-read-per-step.md).
On a CPU none of this waits: `upload` is `torch.tensor` and the clock is `perf_counter`.
"""

from __future__ import annotations

import time

import torch


def upload(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Host values (a list, nested lists, or a host tensor) -> a tensor on `device` (None: the
    host; a tensor already on a GPU is only converted). To a GPU
    through pinned memory without blocking: the copy is queued on the current stream, ahead of
    the kernels that read it, and the pinned buffer is kept until it has run (torch's caching
    host allocator records the stream)."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device is None or torch.device(device).type != "cuda" or host.is_cuda:
        return host.to(device=device, dtype=dtype)
    return host.to(dtype=dtype).pin_memory().to(device, non_blocking=True)


class StepClock:
    """Wall time of the parts of a step, read after the step's one synchronisation.

    `mark(name)` notes a point in the step: the time now on a CPU, an event queued on the stream
    on a GPU (where the host runs ahead of the device, so a host clock would time launches).
    `seconds(a, b)` is the time between two marks; on a GPU call it only after the step has
    read the device, which guarantees both events have passed."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks: dict[str, object] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

    def seconds(self, a: str, b: str) -> float:
        if a not in self.marks or b not in self.marks:
            return 0.0
        if self.cuda:
            return self.marks[a].elapsed_time(self.marks[b]) / 1000.0
        return self.marks[b] - self.marks[a]
