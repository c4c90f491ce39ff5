"""Our own forward for the Llama family, on weights read by rank from the checkpoint.

Owns the math of one forward over a flat, ragged batch of tokens: embeddings, RMSNorm, rotary
embeddings, fused projections, the MLP, the final norm and the LM head. Attention over cached
keys and values is NOT here: each layer calls `attn(layer_idx, q, k, v)`, given by the caller
(the engine's paged KV cache), so this module knows nothing of blocks, sequences or budgets.

Why our own forward: transformers' modules pad a batch to its longest sequence and carry a
per-layer cache object; a speculative step mixes sequences of 1 to k+1 query tokens, so we run
the linear layers over the flat `[num_tokens, hidden]` batch instead. A test holds our logits to
transformers' within 1e-4 in float32.

Tensor parallelism (Megatron style), named where each weight is built: the fused `qkv` and
`gate_up` projections are split by output rows across ranks (column parallel), `o_proj` and
`down_proj` by input columns (row parallel, followed by an all-reduce). Which projection is
column- or row-parallel is read from transformers' own `base_model_tp_plan` for the architecture,
so the split is the one transformers' native tensor-parallel plan declares. Embeddings, norms and
the LM head are replicated (they are small next to the layers).

Loading (`LlamaForward.load`): `needed_tensors` names the tensors the config's model has (as
transformers names them; checked before anything is read), and each rank reads only its part of
each from the safetensors files (`models/checkpoint.py`), one tensor at a time, in the served
dtype, on its device. No process holds the whole checkpoint. `LlamaForward.from_module` runs a
model already in memory (training, tests). Projections on CPU run through
`models/cpu_linear.py`; the elementwise steps run as the C++ calls the caller hands in (`ops`),
or as torch ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from models.checkpoint import Checkpoint, CheckpointError, release_freed_memory
from models.cpu_linear import PROBE_LOGIT_ROWS, Linear

# attn(layer_idx, q [num_tokens, num_heads, head_dim], k, v [num_tokens, num_kv_heads, head_dim])
#   -> [num_tokens, num_heads * head_dim]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

SUPPORTED = {"llama", "mistral", "qwen2"}

@dataclass
class LlamaShape:
    num_layers: int
    hidden_size: int
    num_heads: int          # per rank
    num_kv_heads: int       # per rank
    head_dim: int
    vocab_size: int
    rms_norm_eps: float

    @classmethod
    def from_config(cls, config, tp_size: int = 1) -> "LlamaShape":
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads % tp_size or kv_heads % tp_size:
            raise ValueError(f"tp_size {tp_size} must divide the heads ({heads}) and KV heads "
                             f"({kv_heads})")
        return cls(num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                   num_heads=heads // tp_size, num_kv_heads=kv_heads // tp_size,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   vocab_size=config.vocab_size, rms_norm_eps=config.rms_norm_eps)


PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SPLIT_DIM = {"colwise": 0, "rowwise": 1}     # [out, in]: output rows, or input columns

# get(name, split_dim) -> this rank's part of tensor `name` (None: the tensor is absent)
WeightSource = Callable[[str, "int | None"], "torch.Tensor | None"]


def split_dim(style: str, world: int) -> int | None:
    """The dimension a projection's weight splits along under tensor parallelism."""
    if world == 1:
        return None
    if style not in SPLIT_DIM:
        raise ValueError(f"tensor parallelism needs a colwise/rowwise plan for every projection; "
                         f"transformers' base_model_tp_plan gives {style!r}")
    return SPLIT_DIM[style]


def module_source(hf_model, rank: int, world: int) -> WeightSource:
    """A model in memory as a weight source: its tensors, split by slicing (a tied head is the
    embedding's tensor: absent here, as from a checkpoint that ties it)."""
    tensors = dict(hf_model.state_dict())
    if getattr(hf_model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)

    def get(name: str, dim: int | None):
        t = tensors.get(name)
        if t is None or dim is None or world == 1:
            return t
        return t.chunk(world, dim=dim)[rank].contiguous()

    return get


def checkpoint_source(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, rank: int,
                      world: int) -> WeightSource:
    """A checkpoint as a weight source: each tensor read (only this rank's part) when asked."""
    def get(name: str, dim: int | None):
        if name not in ckpt:
            return None
        return ckpt.read(name, dtype, device, dim, rank, world)

    return get


class LlamaLayerWeights:
    """One decoder layer's weights on this rank: fused and (for tp_size > 1) split."""

    def __init__(self, get: WeightSource, prefix: str, plan: dict, rank: int, world: int,
                 linear: Linear):
        dims = {name: split_dim(plan.get(f"layers.*.{name}", "replicate"), world)
                for name in PROJECTIONS}

        def weight(name):
            return get(f"{prefix}.{name}.weight", dims[name])

        def bias(name):
            # a column-parallel bias follows its rows; a row-parallel one is added once, after
            # the all-reduce, so rank 0 alone holds it
            if dims[name] == SPLIT_DIM["rowwise"] and rank > 0:
                return None
            return get(f"{prefix}.{name}.bias", dims[name] if dims[name] == 0 else None)

        self.input_norm = get(f"{prefix}.input_layernorm.weight", None)
        self.post_norm = get(f"{prefix}.post_attention_layernorm.weight", None)
        qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        biases = [bias(n) for n in qkv]
        self.qkv_bias = torch.cat(biases) if biases[0] is not None else None
        # Column parallel: each rank holds its heads' rows of q, k, v, fused into one matmul.
        self.qkv = linear.prepare(torch.cat([weight(n) for n in qkv], dim=0), self.qkv_bias)
        # Row parallel: each rank holds the input columns of its heads; partial sums are all-reduced.
        self.o_bias = bias("self_attn.o_proj")
        self.o_proj = linear.prepare(weight("self_attn.o_proj"), self.o_bias)
        # Column parallel gate and up (fused), row parallel down.
        self.gate_up = linear.prepare(torch.cat([weight("mlp.gate_proj"), weight("mlp.up_proj")],
                                                dim=0))
        self.down_bias = bias("mlp.down_proj")
        self.down = linear.prepare(weight("mlp.down_proj"), self.down_bias)


def rope_frequencies(config) -> tuple[torch.Tensor, float]:
    """The rotary embedding's inverse frequencies [head_dim / 2] and its attention scaling, as the
    Llama family's rotary module in transformers computes them: its default formula, or
    transformers' own function for a scaled rope type (linear, dynamic, yarn, llama3, ...).
    Computed here rather than by building that module, which would import the architecture's
    modeling code in every engine process and rank
    (docs/decisions/0036-engine-start-without-modeling-code.md)."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        return inv_freq.float(), float(scaling)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return inv_freq, 1.0


# The projections that carry a bias in each architecture, by the config flag that turns them on
# (None: always), as transformers' modeling code builds them. PROJECTIONS lists q, k, v, o, then
# gate, up, down.
_BIASES = {"llama": {"attention_bias": PROJECTIONS[:4], "mlp_bias": PROJECTIONS[4:]},
           "mistral": {},
           "qwen2": {None: PROJECTIONS[:3]}}


def check_architecture(config) -> None:
    """Refuse, with the reason, a config this forward does not compute exactly."""
    if config.model_type not in SUPPORTED:
        raise ValueError(f"the engine runs the Llama family {sorted(SUPPORTED)}; "
                         f"got model_type {config.model_type!r}")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported activation {config.hidden_act!r}")
    if getattr(config, "mlp_bias", False):
        raise ValueError("unsupported: MLP biases (mlp_bias true)")


def needed_tensors(config) -> set[str]:
    """The checkpoint tensors a Llama-family model of `config` has, as transformers names its
    parameters (a test holds this to transformers' own model on the meta device)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not getattr(config, "tie_word_embeddings", False):
        names.add("lm_head.weight")
    biased = [p for flag, projs in _BIASES[config.model_type].items()
              if flag is None or getattr(config, flag, False) for p in projs]
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}"
        names |= {f"{prefix}.input_layernorm.weight", f"{prefix}.post_attention_layernorm.weight"}
        names |= {f"{prefix}.{p}.weight" for p in PROJECTIONS}
        names |= {f"{prefix}.{p}.bias" for p in biased}
    return names


class LlamaForward:
    """Runs a Llama-family model's weights on a flat batch of tokens.

    `rank`/`world` shard the weights; `all_reduce` (e.g. a timed gloo/NCCL all-reduce) sums the
    row-parallel partial outputs and is required when world > 1. Build it with `load` (a
    checkpoint folder, read by rank) or `from_module` (a model in memory).
    """

    def __init__(self, config, get: WeightSource, rope: tuple[torch.Tensor, float],
                 dtype: torch.dtype, device: torch.device, rank: int = 0, world: int = 1,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        check_architecture(config)
        if world > 1 and all_reduce is None:
            raise ValueError("tensor parallelism needs an all_reduce function")
        self.config = config
        self.shape = LlamaShape.from_config(config, world)
        self.rank, self.world, self.all_reduce = rank, world, all_reduce
        self.dtype, self.device = dtype, torch.device(device)
        self.linear = Linear(self.device, dtype)
        self.kernel = self.linear.kernel
        # the elementwise steps as C++ calls (an object with add_norm, rope and silu_mul, each
        # returning None where it does not apply): the model runner sets it where it built them
        self.ops = None
        self._weight_bytes = 0
        source = get

        def get(name: str, dim: int | None):     # bytes as read (before any relayout)
            t = source(name, dim)
            if t is not None:
                self._weight_bytes += t.numel() * t.element_size()
            return t

        plan = dict(getattr(config, "base_model_tp_plan", None) or {})
        self.embed = get("model.embed_tokens.weight", None)
        self.final_norm = get("model.norm.weight", None)
        # the head's row plan first: a layer weight of its shape shares it, up to its rows
        head = get("lm_head.weight", None)
        if head is None:
            if not getattr(config, "tie_word_embeddings", False):
                raise CheckpointError("the checkpoint has no lm_head.weight and does not tie "
                                      "its word embeddings")
            head = self.embed
        self.lm_head = self.linear.prepare(head, None, PROBE_LOGIT_ROWS)
        self.layers = []
        for i in range(config.num_hidden_layers):
            self.layers.append(LlamaLayerWeights(get, f"model.layers.{i}", plan, rank, world,
                                                 self.linear))
            if self.device.type == "cpu":
                release_freed_memory()
        inv_freq, self.rope_scale = rope
        self.inv_freq = inv_freq.detach().float().to(self.device)   # [head_dim / 2]

    @property
    def row_plans(self) -> dict:
        return self.linear.row_plans

    def build_kernels(self, plan_dir=None) -> None:
        """Build what the projections run on (oneDNN's row plans and kernels): at engine start,
        after every weight is loaded, never in a step. `plan_dir`: where row plans are kept
        across starts (`models/cpu_linear.py: Linear`)."""
        if plan_dir is not None:
            self.linear.plan_dir = plan_dir
        self.linear.build_plans()

    def weight_bytes(self) -> int:
        """Bytes of the weights this rank holds, counting a tied head once."""
        return self._weight_bytes

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
             rank: int = 0, world: int = 1,
             all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
             config=None) -> "LlamaForward":
        """This rank's shard of the checkpoint in `path`, read tensor by tensor (no full copy
        on any rank, no float32 detour). Every tensor the meta skeleton names must be there."""
        from transformers import AutoConfig

        config = config or AutoConfig.from_pretrained(str(path))
        check_architecture(config)
        ckpt = Checkpoint(path)
        missing = sorted(needed_tensors(config) - set(ckpt.tensors))
        if missing:
            raise CheckpointError(f"{path} lacks {len(missing)} tensors the model needs, e.g. "
                                  f"{missing[:3]}")
        device = torch.device(device)
        return cls(config, checkpoint_source(ckpt, dtype, device, rank, world),
                   rope_frequencies(config), dtype, device, rank, world, all_reduce)

    @classmethod
    def from_module(cls, hf_model, rank: int = 0, world: int = 1,
                    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> "LlamaForward":
        """A transformers model already in memory (its weights are used in place where
        unsplit), its kernels built."""
        embed = hf_model.model.embed_tokens.weight
        rotary = hf_model.model.rotary_emb
        forward = cls(hf_model.config, module_source(hf_model, rank, world),
                      (rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0))),
                      embed.dtype, embed.device, rank, world, all_reduce)
        forward.build_kernels()
        return forward

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        return self.linear(x, weight, bias)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # As transformers: normalise in float32, cast back, then scale (one fused op in float32).
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps=self.shape.rms_norm_eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.shape.rms_norm_eps)
        return weight * normed.to(x.dtype)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each position: [num_tokens, head_dim], in the model dtype. The first
        half of sin is negated (see `_rope`)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin() * self.rope_scale
        sin[:, :freqs.shape[1]].neg_()
        return (emb.cos() * self.rope_scale).to(self.dtype), sin.to(self.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """transformers' x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1) written
        (x2, x1) * (-sin1, sin2): three ops for the queries and keys of all heads at once.
        x: [num_tokens, heads, head_dim]; cos, signed_sin: [num_tokens, 1, head_dim]"""
        half = x.shape[-1] // 2
        swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
        return torch.addcmul(x * cos, swapped, signed_sin)

    def _add_norm(self, hidden: torch.Tensor, delta: torch.Tensor | None,
                  weight: torch.Tensor) -> torch.Tensor:
        """hidden += delta (in place), then its norm: one C++ call where `ops` is set."""
        if self.ops is not None:
            out = self.ops.add_norm(hidden, delta, weight, self.shape.rms_norm_eps)
            if out is not None:
                return out
        if delta is not None:
            hidden.add_(delta)
        return self._norm(hidden, weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionFn) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        s = self.shape
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        heads = s.num_heads + s.num_kv_heads
        hidden = F.embedding(input_ids, self.embed)            # the residual stream, added in place
        cos, sin = self.rotary(positions)
        x = self._add_norm(hidden, None, self.layers[0].input_norm if self.layers else self.final_norm)
        for i, layer in enumerate(self.layers):
            qkv = self._linear(x, layer.qkv, layer.qkv_bias)
            qk = self.ops.rope(qkv, heads, s.head_dim, cos, sin) if self.ops else None
            if qk is None:
                qk = self._rope(qkv[:, :q_size + kv_size].view(-1, heads, s.head_dim),
                                cos[:, None, :], sin[:, None, :])
            q, k = qk[:, :s.num_heads], qk[:, s.num_heads:]
            v = qkv[:, q_size + kv_size:].view(-1, s.num_kv_heads, s.head_dim)
            out = self._linear(attn(i, q, k, v), layer.o_proj, layer.o_bias)
            if self.world > 1:
                out = self.all_reduce(out)
            x = self._add_norm(hidden, out, layer.post_norm)
            gate_up = self._linear(x, layer.gate_up)
            act = self.ops.silu_mul(gate_up) if self.ops else None
            if act is None:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            out = self._linear(act, layer.down, layer.down_bias)
            if self.world > 1:
                out = self.all_reduce(out)
            last = i + 1 == len(self.layers)
            x = self._add_norm(hidden, out, self.final_norm if last else self.layers[i + 1].input_norm)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> [num_rows, vocab_size] in float32."""
        return self._linear(hidden, self.lm_head).float()
