"""Counting, on a CPU, what would make a GPU's host wait (`engine/host_sync.py`).

`HostSyncs` is a `TorchFunctionMode` that counts the calls this repository's code makes that
read a tensor's values on the host (`tolist`, `item`, `bool`, `int`, `float`, `nonzero`,
`numpy`, `cpu`, and indexing by a boolean mask) and the copies to a device that block
(`torch.tensor` / `as_tensor` given a device, `Tensor.to` a device without `non_blocking`,
indexing by a Python list),
by call site. On a CPU every tensor is a host tensor, so the count also holds reads of tensors
the code keeps on the host by design; a site in the list is there to be looked at.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = str(Path(__file__).resolve().parents[1]) + "/"
READS = {"tolist", "item", "__bool__", "__int__", "__index__", "__float__", "nonzero", "numpy",
         "cpu"}
INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put"}


def _index_parts(args) -> tuple:
    index = args[1] if len(args) > 1 else None
    return index if isinstance(index, tuple) else (index,)


def _bool_index(args) -> bool:
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in _index_parts(args))


def _list_index(args) -> bool:
    """Indexing by a Python list: torch makes a host index tensor and copies it up."""
    return any(isinstance(p, list) for p in _index_parts(args))


class HostSyncs(TorchFunctionMode):
    def __init__(self, tests: bool = False):
        super().__init__()
        self.tests = tests                # count calls from tests/ too (the counter's own test)
        self.reads: collections.Counter = collections.Counter()
        self.uploads: collections.Counter = collections.Counter()

    def _site(self) -> str | None:
        """The caller's file:line when the call is made by this repository's code."""
        frame = sys._getframe(2)
        name = frame.f_code.co_filename
        if (not name.startswith(ROOT) or "/.venv/" in name
                or (name.startswith(ROOT + "tests/") and not self.tests)):
            return None
        return f"{name[len(ROOT):]}:{frame.f_lineno}"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS or (name in INDEXING and _bool_index(args)):
            site = self._site()
            if site:
                self.reads[f"{site} {name}"] += 1
        elif ((name in ("tensor", "as_tensor") and kwargs.get("device") is not None)
              or (name in INDEXING and _list_index(args))
              or (name == "to" and not kwargs.get("non_blocking")
                  and any(isinstance(a, (torch.device, str)) for a in args[1:]))):
            site = self._site()
            if site:
                self.uploads[f"{site} {name}"] += 1
        return func(*args, **kwargs)
