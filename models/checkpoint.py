"""Read a rank's slices of a safetensors checkpoint, one tensor at a time.

Owns: the tensor index of a checkpoint folder (every `*.safetensors` file's header: name ->
file, dtype, shape) and reading one tensor, whole or one rank's part of it, straight into the
served dtype on the served device. A tensor-parallel rank reads only its rows or columns
(`safe_open(...).get_slice`), so no process ever holds more than its own shard plus the one
tensor in flight: a 70B checkpoint is never materialised whole on any rank.

Each read opens the file afresh: safetensors maps the whole file, and the pages a read touches
count towards the process's resident memory until the mapping closes, so a handle kept open
over a shard file would hold every page read from it.
Does not own: which tensors a model needs nor how they are split (`models/llama.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F64": torch.float64, "I64": torch.int64, "I32": torch.int32}


def release_freed_memory() -> None:
    """Hand the C allocator's free pages back to the OS (glibc's `malloc_trim`), so what loading
    freed (a weight's relayout source, a fused weight's parts) does not stay resident between
    the weights kept. A no-op where there is no glibc."""
    global _trim
    if _trim is None:
        try:
            import ctypes

            _trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _trim = False
    if _trim:
        _trim(0)


_trim = None


class CheckpointError(ValueError):
    """A checkpoint that cannot be read by rank; the message says why and what to do."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def _header(file: Path) -> dict:
    with file.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size))


class Checkpoint:
    """The tensors of a local Hugging Face folder in safetensors form."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            if list(self.path.glob("*.bin")):
                raise CheckpointError(
                    f"{self.path} holds PyTorch .bin weights; the engine reads safetensors only, "
                    f"one slice per rank. Convert once: load it with transformers and "
                    f"save_pretrained(folder, safe_serialization=True)")
            raise CheckpointError(f"{self.path} has no *.safetensors weights")
        self.tensors: dict[str, TensorInfo] = {}
        for file in files:
            for name, meta in _header(file).items():
                if name == "__metadata__":
                    continue
                if meta["dtype"] not in SAFETENSORS_DTYPES:
                    raise CheckpointError(f"{file}: tensor {name} has dtype {meta['dtype']}, "
                                          f"which the engine does not serve")
                self.tensors[name] = TensorInfo(file, SAFETENSORS_DTYPES[meta["dtype"]],
                                                tuple(meta["shape"]))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def read(self, name: str, dtype: torch.dtype, device: torch.device | str = "cpu",
             split_dim: int | None = None, rank: int = 0, world: int = 1) -> torch.Tensor:
        """Tensor `name` in `dtype` on `device`; with `split_dim`, only part `rank` of `world`
        equal parts along that dimension (the checkpoint's other parts are never read)."""
        from safetensors import safe_open

        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path} has no tensor {name!r}")
        index: tuple = ()
        if split_dim is not None and world > 1:
            size = info.shape[split_dim]
            if size % world:
                raise CheckpointError(f"{name}: dimension {split_dim} ({size}) does not split "
                                      f"into {world} equal parts")
            part = size // world
            index = (slice(None),) * split_dim + (slice(rank * part, (rank + 1) * part),)
        with safe_open(str(info.file), framework="pt", device="cpu") as handle:
            view = handle.get_slice(name)
            tensor = view[index] if index else view[:]
        tensor = tensor.to(dtype)
        return tensor.to(device) if torch.device(device).type != "cpu" else tensor.contiguous()
