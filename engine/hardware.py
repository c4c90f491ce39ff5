"""Datasheet presets of GPUs and models, and the roofline step cost derived from them.

For machines we cannot run on (the simulator's 70B over four A100s): `GPUS` and `MODELS` are the
catalogue, `RooflineStepCost` a `engine.step_cost.StepCostModel` computed from it, max(bytes /
bandwidth, FLOPs / matmul rate) per forward plus tensor-parallel all-reduces. Pure Python, like
the cost model: no torch, no Ray. Measured costs (what an engine profiles on its own device)
live in `engine/step_cost.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet rates of one GPU, and the fraction of them a real kernel reaches."""

    name: str
    memory_bytes: int  # device memory
    mem_bw_Bps: float  # datasheet HBM bandwidth, bytes/s
    matmul_flops: float  # datasheet dense bf16 tensor-core rate, FLOP/s
    link_Bps: float  # NVLink all-reduce bus bandwidth per GPU, bytes/s (achieved, nccl-tests)
    allreduce_latency_s: float = 10e-6  # small-message all-reduce on NVLink, order of nccl-tests
    # Achieved fractions, measured on this project's H200: 4.3 of 4.8 TB/s copy, 788 of 989
    # TFLOP/s bf16 matmul. Applied to every preset (an assumption for A100 and H100).
    mem_efficiency: float = 4.3 / 4.8
    matmul_efficiency: float = 788.0 / 989.0

    @property
    def mem_bw(self) -> float:  # achieved bytes/s
        return self.mem_bw_Bps * self.mem_efficiency

    @property
    def flops(self) -> float:  # achieved FLOP/s
        return self.matmul_flops * self.matmul_efficiency


GPUS: dict[str, GPUSpec] = {
    # NVIDIA A100 datasheet (SXM4 80GB): 80 GB HBM2e (81,920 MiB), 2,039 GB/s, 312 TFLOP/s bf16
    # dense, NVLink3 600 GB/s bidirectional (~230 GB/s all-reduce bus bandwidth in nccl-tests).
    "A100-80GB": GPUSpec("A100-80GB", 80 * GiB, 2.039e12, 312e12, 230e9),
    # NVIDIA H100 datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s bf16 dense,
    # NVLink4 900 GB/s bidirectional (~360 GB/s all-reduce bus bandwidth).
    "H100-SXM": GPUSpec("H100-SXM", 80 * GiB, 3.35e12, 989e12, 360e9),
    # NVIDIA H200 datasheet: 141 GB HBM3e (about 140 GiB usable), 4.8 TB/s, 989 TFLOP/s bf16
    # dense, NVLink4 900 GB/s. This project's H200 measured 4.3 TB/s copy, 788 TFLOP/s matmul.
    "H200": GPUSpec("H200", 140 * GiB, 4.8e12, 989e12, 360e9),
}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape (Llama layout: GQA attention, SwiGLU MLP)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int = 0  # 0: hidden_size // num_heads

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.hd, self.num_kv_heads * self.hd
        attn = h * q + 2 * h * kv + q * h  # q, k, v, o projections
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        return attn + mlp + 2 * h  # + two RMSNorm weights

    def matmul_params(self) -> int:
        """Weights every token multiplies by: all layers and the LM head (not the lookup)."""
        return self.num_layers * self.layer_params() + self.vocab_size * self.hidden_size

    def param_count(self) -> int:
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return self.num_layers * self.layer_params() + embed + head + self.hidden_size

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        return self.param_count() * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V for every layer: 2 x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.hd * dtype_bytes

    def rank_weight_bytes(self, tp: int = 1, dtype_bytes: int = 2) -> int:
        """What one of `tp` ranks holds: its part of every layer, and the embeddings, LM head
        and final norm whole (they are replicated, `models/llama.py`)."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return (self.num_layers * self.layer_params() // tp + embed + head
                + self.hidden_size) * dtype_bytes

    @classmethod
    def from_hf_config(cls, name: str, config: dict) -> "ModelSpec":
        """A checkpoint's config.json (Llama family) as a ModelSpec."""
        heads = config["num_attention_heads"]
        return cls(name, config["num_hidden_layers"], config["hidden_size"], heads,
                   config.get("num_key_value_heads") or heads, config["intermediate_size"],
                   config["vocab_size"], bool(config.get("tie_word_embeddings", False)),
                   config.get("head_dim") or 0)


def model_spec_for(path: str, config: dict | None = None) -> ModelSpec:
    """A checkpoint's shape: from its config.json when given, else the preset whose name the
    folder's name contains (the longest such), e.g. /models/Llama-2-70b-hf -> Llama-2-70B."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if config is not None:
        return ModelSpec.from_hf_config(name, config)
    matches = [m for key, m in MODELS.items() if key.lower() in name.lower()]
    if not matches:
        raise KeyError(f"no config.json at {path} and no preset named in {name!r}; presets: "
                       f"{sorted(MODELS)}")
    return max(matches, key=lambda m: len(m.name))


MODELS: dict[str, ModelSpec] = {
    # meta-llama/Llama-2-70b-hf config.json (GQA, 8 KV heads)
    "Llama-2-70B": ModelSpec("Llama-2-70B", 80, 8192, 64, 8, 28672, 32000),
    # meta-llama/Llama-2-7b-hf config.json (full multi-head attention: 32 KV heads)
    "Llama-2-7B": ModelSpec("Llama-2-7B", 32, 4096, 32, 32, 11008, 32000),
    # meta-llama/Meta-Llama-3-8B config.json
    "Llama-3-8B": ModelSpec("Llama-3-8B", 32, 4096, 32, 8, 14336, 128256),
    # meta-llama/Llama-3.2-1B config.json (head_dim 64, tied embeddings)
    "Llama-3.2-1B": ModelSpec("Llama-3.2-1B", 16, 2048, 32, 8, 8192, 128256, True, 64),
}


@dataclass
class RooflineStepCost:
    """StepCostModel from a roofline: max(bytes / bandwidth, FLOPs / matmul rate) per forward,
    plus tensor-parallel all-reduces over NVLink and a fixed per-forward overhead.

    tp shards the target over tp GPUs; draft_tp shards the draft (1: whole on one GPU, which
    then reads all draft weights alone while the other GPUs wait).
    """

    gpu: GPUSpec
    target: ModelSpec
    draft: ModelSpec | None = None
    tp: int = 1
    draft_tp: int = 1
    dtype_bytes: int = 2
    kv_dtype_bytes: int = 2
    overhead_s: float = 2e-3  # per target step: scheduling, sampling, launches
    draft_overhead_s: float = 0.5e-3  # per draft round (CUDA-graphed, no scheduling)

    def target_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        return self._forward_s(self.target, self.tp, num_seqs, num_tokens, context_tokens) + self.overhead_s

    def draft_s(self, num_seqs: int, num_tokens: int, context_tokens: int = 0) -> float:
        if self.draft is None:
            raise ValueError("RooflineStepCost has no draft model")
        return (self._forward_s(self.draft, self.draft_tp, num_seqs, num_tokens, context_tokens)
                + self.draft_overhead_s)

    def _forward_s(self, m: ModelSpec, tp: int, num_seqs: int, num_tokens: int, ctx: int) -> float:
        if num_tokens <= 0:
            return 0.0
        kv_shards = min(tp, m.num_kv_heads)
        kv_tok = m.kv_bytes_per_token(self.kv_dtype_bytes) / kv_shards
        bytes_ = m.matmul_params() * self.dtype_bytes / tp + (ctx + num_tokens) * kv_tok
        ctx_per_query = ctx / max(num_seqs, 1)
        attn = 4 * m.num_layers * m.num_heads * m.hd * ctx_per_query  # QK^T and AV, per token
        flops = num_tokens * (2 * m.matmul_params() + attn) / tp
        t = max(bytes_ / self.gpu.mem_bw, flops / self.gpu.flops)
        if tp > 1:  # two all-reduces per layer of [num_tokens, hidden] activations (ring)
            msg = num_tokens * m.hidden_size * self.dtype_bytes * 2 * (tp - 1) / tp
            t += 2 * m.num_layers * (self.gpu.allreduce_latency_s + msg / self.gpu.link_Bps)
        return t
