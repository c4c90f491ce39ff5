"""Building the engine's C++ kernels (`engine/cpu_attention.py`'s and `engine/cpu_ops.py`'s)
with inductor's C++ cache, and whether this process can build them at all.

Inductor compiles a kernel once per machine and keeps the library in its cache, but reaching that
library costs every process an import of inductor and a probe of the vector instruction sets
the compiler can target (a child Python per ISA): seconds of each engine process's start (a
replica, a tensor-parallel rank, an in-place restart; figures in
docs/decisions/0004-cpu-kernels.md). So the library each kernel resolved to is recorded
(`RECORD_DIR`), under a key of everything inductor's own key depends on here: the source, the
argument types, the CPU, torch, the compiler and inductor's settings from the environment. A
later process with the same key loads that library directly, the way inductor loads it; one
without a record, or whose library is gone, builds through inductor.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

C_TYPES = {torch.float32: "float", torch.bfloat16: "at::BFloat16", torch.float16: "at::Half"}
RECORD_DIR = Path.home() / ".cache" / "specserve" / "kernels"
# inductor's generated bindings read the address of this torch function from the environment
_DATA_PTR_ENV = "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"


def record_key(code: str, types: list[str]) -> str:
    """A kernel's record key: its source and argument types, this machine's CPU and torch
    (`models/cpu_linear.py`'s machine key), the C++ compiler (path, size, time) and every
    environment setting inductor or ATen read to choose flags."""
    from models.cpu_linear import _machine

    compiler = os.environ.get("CXX") or "c++"
    found = shutil.which(compiler)
    stat = os.stat(found) if found else None
    # not the cache folder, which inductor's import sets (the record holds the library's path)
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith(("TORCHINDUCTOR_", "ATEN_CPU_", "CXX", "CC"))
                 and k != "TORCHINDUCTOR_CACHE_DIR")
    material = [code, repr(types), _machine(), str(found),
                f"{stat.st_size}|{stat.st_mtime_ns}" if stat else "", repr(env)]
    return hashlib.sha256("\n".join(material).encode()).hexdigest()[:32]


def _load_recorded(path: Path, key: str):
    """The kernel of the library a record names, loaded as inductor loads it; None where there
    is no record or its library is gone."""
    try:
        library = json.loads(path.read_text())["library"]
    except (OSError, ValueError, KeyError):
        return None
    if not os.path.isfile(library):
        return None
    os.environ[_DATA_PTR_ENV] = str(torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr)
    spec = importlib.util.spec_from_file_location(f"specserve_{key}.kernel", library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kernel


def _build(code: str, types: list[str], path: Path | None):
    """Build (or find in inductor's cache) the kernel, and record its library at `path` (None:
    no record)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache   # seconds to import

    fn = CppPythonBindingsCodeCache.load_pybinding(types, code)
    library = getattr(getattr(fn, "__self__", None), "__file__", None)
    if path is not None and library:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"library": library}))
            tmp.replace(path)
        except OSError as e:
            log.debug("kernel record not written (%s)", e)
    return fn


class _Built:
    """C++ sources built once per (source, dtype, head size) in this process; `failed` keeps
    why building failed here (no compiler, an unsupported platform), after which callers take
    their torch path."""

    def __init__(self, record_dir: Path | None = RECORD_DIR):
        self._lock = threading.Lock()
        self._fns: dict[tuple, object] = {}
        self.failed: str | None = None
        self.builds = 0                  # sources built (or loaded from disk) in this process
        self.recorded = 0                # of those, loaded from a record, inductor not asked
        self.record_dir = record_dir     # None: no records, inductor every time

    def get(self, name: str, source: str, args: list[str], dtype: torch.dtype, d: int = 0):
        """The built function, or None where building fails here (logged once)."""
        key = (name, dtype, d)
        fn = self._fns.get(key)
        if fn is not None or self.failed is not None:
            return fn
        try:
            with self._lock:
                if key not in self._fns:
                    c_type = C_TYPES[dtype]
                    code = source.replace("@T@", c_type).replace("@D@", str(d))
                    types = [a.replace("T", c_type) if a.startswith(("T", "const T")) else a
                             for a in args]
                    self._fns[key] = self._load(code, types)
                    self.builds += 1
                return self._fns[key]
        except Exception as e:
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("CPU attention kernels unavailable (%s); using gather + SDPA", self.failed)
            return None

    def _load(self, code: str, types: list[str]):
        if self.record_dir is None:
            return _build(code, types, None)
        key = record_key(code, types)
        path = self.record_dir / f"{key}.json"
        try:
            fn = _load_recorded(path, key)
        except Exception as e:          # noqa: BLE001 - a broken library: build it again
            log.warning("kernel record %s unusable (%s); building through inductor", path, e)
            fn = None
        if fn is not None:
            self.recorded += 1
            return fn
        return _build(code, types, path)


cpp_kernels = _Built()
