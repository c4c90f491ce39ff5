"""Kernels loaded from their records (engine/cpp_build.py): the same functions as inductor's
build, without importing inductor; a record whose library is gone, or that is unreadable, falls
back to inductor; the key follows the source, the types and the environment's settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from engine import cpu_ops
from engine.cpp_build import _Built, record_key

REPO = Path(__file__).resolve().parents[2]
ARGS = ["const T*", "T*"] + ["const int64_t"] * 3


def _silu(built: _Built):
    return built.get("silu_mul", cpu_ops._SILU_MUL, ARGS, torch.bfloat16)


def _run(fn, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    fn(x, out, x.shape[0], x.shape[1] // 2, x.stride(0))
    return out


def test_a_recorded_kernel_is_the_built_one(tmp_path):
    first = _Built(tmp_path)
    built = _silu(first)
    assert built is not None and first.recorded == 0
    assert len(list(tmp_path.glob("*.json"))) == 1
    second = _Built(tmp_path)
    loaded = _silu(second)
    assert second.recorded == 1 and second.builds == 1
    assert loaded.__self__.__file__ == built.__self__.__file__
    x = torch.randn(5, 48).to(torch.bfloat16)
    assert torch.equal(_run(loaded, x), _run(built, x))
    assert torch.equal(_run(loaded, x), cpu_ops.silu_mul(x))


def test_a_record_without_its_library_or_unreadable_builds_again(tmp_path, caplog):
    """Quietly: a library inductor's cache no longer holds (a cleared /tmp) is no fault."""
    _silu(_Built(tmp_path))
    record = next(tmp_path.glob("*.json"))
    library = json.loads(record.read_text())["library"]
    record.write_text(json.dumps({"library": library + ".gone"}))
    again = _Built(tmp_path)
    assert _silu(again) is not None and again.recorded == 0
    assert json.loads(record.read_text())["library"] == library       # recorded afresh
    record.write_text("{not json")
    torn = _Built(tmp_path)
    assert _silu(torn) is not None and torn.recorded == 0 and torn.failed is None
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_the_key_follows_source_types_and_settings(monkeypatch):
    key = record_key("code", ["T*"])
    assert record_key("code", ["T*"]) == key
    assert record_key("code ", ["T*"]) != key
    assert record_key("code", ["const T*"]) != key
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert record_key("code", ["T*"]) != key
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")   # inductor's import sets it
    assert record_key("code", ["T*"]) == key


def test_a_second_process_builds_its_kernels_without_inductor(tmp_path):
    """What the records are for: an engine process whose kernels were built before on this
    machine starts without importing inductor (about 3 s of its start)."""
    script = f"""
import sys, torch
from pathlib import Path
from engine import cpp_build, cpu_attention, cpu_ops
cpp_build.cpp_kernels.record_dir = Path({str(tmp_path)!r})
for dtype in (torch.bfloat16, torch.float32):
    assert cpu_attention.build(dtype, 16)
    assert cpp_build.cpp_kernels.get("silu_mul", cpu_ops._SILU_MUL, {ARGS!r}, dtype) is not None
print(cpp_build.cpp_kernels.recorded, "torch._inductor.codecache" in sys.modules)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, timeout=300, cwd=REPO) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert runs[0].stdout.split() == ["0", "True"]
    assert runs[1].stdout.split() == ["6", "False"]


def test_without_a_record_folder_nothing_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setattr("engine.cpp_build.RECORD_DIR", tmp_path)
    plain = _Built(None)
    assert _silu(plain) is not None and plain.recorded == 0 and plain.builds == 1
    assert not list(tmp_path.iterdir())
