"""Load causal LMs from local Hugging Face folders, and count their bytes.

Owns: reading a checkpoint folder (config, safetensors, tokenizer) for serving, as one rank's
shard run by our own forward (`load_served`, `ServedModel`), or whole into a transformers
`nn.Module` for training and reference checks (`load_model`), in a chosen dtype and device;
the stop tokens a checkpoint declares; refusing bad inputs (missing or corrupt files, an unusable dtype, a draft
whose vocabulary differs from its target's) before anything runs; weight bytes and KV-cache bytes
per token, which the engine's memory budget uses. Does not own: inference (see `engine/`), nor
downloads: every path is a local folder, and the hub is never contacted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class ModelLoadError(ValueError):
    """A checkpoint, dtype or model pair that cannot be served; the message says why."""


def native_bf16(device: str | torch.device = "cpu") -> bool:
    """The device computes bfloat16 natively: a CUDA GPU with bf16, or a CPU whose oneDNN has
    bf16 kernels (AVX512-BF16 or AMX). On an AVX2-only CPU bf16 matmuls are emulated and run
    several times slower than float32 (docs/decisions/0003-dtype-auto.md)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype name -> torch dtype; "auto" is bfloat16 where the device computes it natively,
    else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {sorted(set(DTYPES))}")
    return DTYPES[dtype]


def check_dtype_on_device(dtype: torch.dtype, device: str | torch.device) -> None:
    """Refuse a dtype the device cannot run, by running one tiny matmul in it."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but no CUDA device is available")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ModelLoadError(f"bfloat16 is not supported on {torch.cuda.get_device_name(device)}")
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device)
        (a @ a).sum().item()
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"dtype {dtype} cannot run on device {device}: {exc}") from exc


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V one token costs across all layers: 2 x layers x kv_heads x head_dim x size."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * text.num_hidden_layers * kv_heads * head_dim * element


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters and buffers, counting tied (shared) tensors once."""
    seen: set[int] = set()
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


@dataclass
class LoadedModel:
    path: Path
    model: torch.nn.Module          # eval mode, on `device`, in `dtype`
    tokenizer: object | None        # a transformers tokenizer, or None if the folder has none
    config: object                  # the transformers config
    dtype: torch.dtype
    device: torch.device
    num_params: int
    weight_bytes: int
    kv_bytes_per_token: int

    @property
    def vocab_size(self) -> int:
        return self.config.get_text_config().vocab_size

    def summary(self) -> dict:
        return {"path": str(self.path), "architecture": type(self.model).__name__,
                "dtype": str(self.dtype).removeprefix("torch."), "device": str(self.device),
                "num_params": self.num_params, "weight_bytes": self.weight_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token, "vocab_size": self.vocab_size}


def _check_folder(path: Path) -> dict:
    if not path.is_dir():
        raise ModelLoadError(f"model folder {path} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face checkpoint")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file} is not valid JSON: {exc}") from exc
    weights = list(path.glob("*.safetensors")) + list(path.glob("*.bin"))
    if not weights:
        raise ModelLoadError(f"{path} has no weights (*.safetensors or *.bin)")
    for file in path.glob("*.safetensors"):
        _check_safetensors(file)
    return config


def _check_safetensors(file: Path) -> None:
    """Validate the header and the data length, so a truncated file fails before loading."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            keys = list(handle.keys())
        header_len = int.from_bytes(file.open("rb").read(8), "little")
        header = json.loads(file.open("rb").read(8 + header_len)[8:])
    except Exception as exc:  # safetensors raises its own error types
        raise ModelLoadError(f"{file} is corrupt: {exc}") from exc
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if file.stat().st_size < 8 + header_len + end or not keys:
        raise ModelLoadError(f"{file} is corrupt: truncated ({file.stat().st_size} bytes, "
                             f"header promises {8 + header_len + end})")


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ModelLoadError(f"tokenizer in {path} cannot be loaded: {exc}") from exc


def _checked(path: str | Path, dtype, device) -> tuple[Path, torch.dtype]:
    """The folder, checked (config, weights, safetensors headers), and a dtype the device runs."""
    path = Path(path).expanduser().resolve()
    _check_folder(path)
    torch_dtype = resolve_dtype(dtype, device)
    check_dtype_on_device(torch_dtype, device)
    return path, torch_dtype


def load_model(path: str | Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu") -> LoadedModel:
    """Load any `AutoModelForCausalLM` checkpoint from a local folder, checked first."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path, torch_dtype = _checked(path, dtype, device)
    try:
        config = AutoConfig.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the model in {path}: {exc}") from exc
    model.to(device).eval()
    tokenizer = load_tokenizer(path)
    return LoadedModel(path=path, model=model, tokenizer=tokenizer, config=config,
                       dtype=torch_dtype, device=torch.device(device),
                       num_params=sum(p.numel() for p in model.parameters()),
                       weight_bytes=weight_bytes(model),
                       kv_bytes_per_token=kv_bytes_per_token(config, torch_dtype))


def eos_token_ids(path: str | Path, config) -> tuple[int, ...]:
    """The ids that end generation, as transformers' `generate` reads them: the folder's
    `generation_config.json` where it names them (Llama-3 Instruct lists both <|end_of_text|>
    and <|eot_id|> there), else the model config's."""
    eos = None
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{gen} is not valid JSON: {exc}") from exc
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]))


@dataclass
class ServedModel:
    """One rank's shard of a checkpoint, ready to run (`forward`), and what serving reads of it."""
    path: Path
    forward: object                 # models.llama.LlamaForward
    tokenizer: object | None        # rank 0 only (None on other ranks or without one)
    config: object
    dtype: torch.dtype
    device: torch.device
    num_params: int                 # of the whole checkpoint
    weight_bytes: int               # this rank's, as served
    kv_bytes_per_token: int         # the whole model's (every rank's KV heads)
    eos_token_ids: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        return self.config.get_text_config().vocab_size


def load_served(path: str | Path, dtype: str | torch.dtype = "auto",
                device: str | torch.device = "cpu", rank: int = 0, world: int = 1,
                all_reduce=None, tokenizer: bool = True) -> ServedModel:
    """Rank `rank` of `world`'s shard of a safetensors checkpoint, read tensor by tensor
    straight into `dtype` on `device` (`models/llama.py`, `LlamaForward.load`): no process
    holds more than its shard plus the one tensor being read. Checked first like `load_model`."""
    from transformers import AutoConfig

    from models.checkpoint import Checkpoint, CheckpointError
    from models.llama import LlamaForward

    path, torch_dtype = _checked(path, dtype, device)
    try:
        config = AutoConfig.from_pretrained(str(path))
        ckpt = Checkpoint(path)
        forward = LlamaForward.load(path, torch_dtype, device, rank, world, all_reduce, config)
    except CheckpointError as exc:
        raise ModelLoadError(str(exc)) from exc
    except (OSError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the model in {path}: {exc}") from exc
    num_params = sum(t.nbytes // torch.empty((), dtype=t.dtype).element_size()
                     for t in ckpt.tensors.values())
    return ServedModel(path=path, forward=forward,
                       tokenizer=load_tokenizer(path) if tokenizer else None, config=config,
                       dtype=torch_dtype, device=torch.device(device), num_params=num_params,
                       weight_bytes=forward.weight_bytes(),
                       kv_bytes_per_token=kv_bytes_per_token(config, torch_dtype),
                       eos_token_ids=eos_token_ids(path, config))


def check_compatible(target: LoadedModel, draft: LoadedModel, role: str = "draft") -> None:
    """A draft must share the target's vocabulary: same size, same token for every id."""
    if target.vocab_size != draft.vocab_size:
        raise ModelLoadError(f"{role} vocabulary size {draft.vocab_size} differs from the target's "
                             f"{target.vocab_size} ({draft.path} vs {target.path})")
    if target.tokenizer is None or draft.tokenizer is None:
        return
    if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ModelLoadError(f"{role} tokenizer in {draft.path} maps tokens to ids differently "
                             f"from the target's in {target.path}")


@dataclass
class Family:
    target: LoadedModel
    draft: LoadedModel | None = None
    small: LoadedModel | None = None


def load_family(target: str | Path, draft: str | Path | None = None, small: str | Path | None = None,
                dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu") -> Family:
    """Load a target with its draft and small model; refuse a draft whose vocabulary differs.

    The small model is its own tier, so only its tokenizer must match (requests are the same text).
    """
    target_model = load_model(target, dtype, device)
    family = Family(target=target_model)
    if draft is not None:
        family.draft = load_model(draft, dtype, device)
        check_compatible(target_model, family.draft, "draft")
    if small is not None:
        family.small = load_model(small, dtype, device)
        check_compatible(target_model, family.small, "small model")
    return family
