"""Our own forward for the Llama family, on the weights transformers loaded.

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
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import cpu_ops

# attn(layer_idx, q [num_tokens, num_heads, head_dim], k, v [num_tokens, num_kv_heads, head_dim])
#   -> [num_tokens, num_heads * head_dim]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

SUPPORTED = {"llama", "mistral", "qwen2"}

# oneDNN keeps the last 1024 kernels it built in a process; a target and its draft at every
# bucketed row count (`onednn_rows`, built by `RowPlan`) need ~1,500, and with 1024 the
# first ones built were rebuilt in serving (0.7 ms each). Read at oneDNN's first use, so set
# here, before any model is built; a value the user set wins.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "4096")


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


def _split(weight: torch.Tensor, style: str, rank: int, world: int) -> torch.Tensor:
    """Take this rank's part of a weight: 'colwise' splits output rows, 'rowwise' input columns."""
    if world == 1:
        return weight
    if style not in ("colwise", "rowwise"):
        raise ValueError(f"tensor parallelism needs a colwise/rowwise plan for every projection; "
                         f"transformers' base_model_tp_plan gives {style!r}")
    dim = 0 if style == "colwise" else 1
    return weight.chunk(world, dim=dim)[rank].contiguous()


def _cpu_kernel(dtype: torch.dtype = torch.float32) -> str:
    """How projections run on CPU, measured on this project's 2-core AMD machine (fp32):

    - "onednn": oneDNN with weights prepacked once (the kernel torch.compile's CPU backend
      uses). Each output row is computed the same way whatever the number of rows up to a
      per-shape set of row counts the forward measures and keeps its calls to (`RowPlan`), so
      a token's logits do not depend on what else is in the batch (bitwise, tested), and
      2-16 rows cost little more than one (5 rows of the target's MLP: 76 us against MKL's
      143 us; one row 51 against 42). Verifying k + 1 tokens is then nearly free, as on a GPU.
    - "mkl": [in, out] weights through MKL (x @ W), 1.2-2.7x faster than F.linear's [out, in]
      at one row; the fallback where the oneDNN ops are missing.
    - bfloat16: oneDNN prepacked where the CPU has bf16 kernels (AVX512-BF16/AMX); elsewhere
      F.linear ("torch"), 3-4x faster than x @ W in emulated bf16 (and both ~8x slower than fp32,
      which is why dtype "auto" picks float32 on such CPUs).
    """
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2, dtype=dtype), w, None, "none", [], "")
        return "onednn"
    except (AttributeError, RuntimeError, NotImplementedError):
        return "mkl" if dtype == torch.float32 else "torch"


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN projection runs at: exact up to EXACT_ROWS, above that rounded up
    to one of 8 steps an octave (at most 12.5% of padding, zero rows whose outputs are dropped).

    oneDNN builds a kernel for each new input shape and keeps the last 1024 (per process): a
    first call at a row count costs ~0.75 ms against ~0.07 (the target's MLP, bf16, AMX Xeon),
    and a speculative or chunked-prefill batch brings a new row count nearly every step
    (n x (k + 1) verify rows, prompt chunks of any size). The first adaptive run at batch 16
    paid ~0.3 s of a 1.2 s run for that (0.77x a second, identical run). Bucketed, a model's
    ~72 row counts up to 2048 and its five weight shapes stay cached. A row's output does not
    depend on the other rows (`_cpu_kernel`), so the padding changes no bit of it (tests)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << max(0, rows.bit_length() - 4)          # 8 steps in (2^(e-1), 2^e]
    return -(-rows // step) * step


EXACT_ROWS = 16
PROBE_ROWS = 2048    # row counts tried for bit-exact rows (`RowPlan`); the LM head's up to
PROBE_LOGIT_ROWS = 512   # (a step's logit rows: its sequences' 1 + k); beyond, in pieces
ALONE_ROWS = 256     # rows a plan computes one at a time, the reference for calls up to that


def _timed(run, x: torch.Tensor) -> float:
    start = time.perf_counter()
    run(x)
    return time.perf_counter() - start


class RowPlan:
    """How one oneDNN projection runs any number of rows with every row's output the bits it
    gets alone: as calls at row counts found to keep them ("good" buckets of `onednn_rows`),
    chosen to cost least.

    At some row counts oneDNN splits the sum over the input dimension differently (bfloat16,
    AMX Xeon, reference-py's 864-wide down projection: 36 to 288 rows; its draft's 688-wide one
    96 to 240 but for 128; float32 from 2 rows once the input is 2048 wide), and a token's
    logits then depended on how many rows were computed beside it: a verify forward (n x (k +
    1) rows) no longer gave what plain decoding (n rows) gives, and greedy speculative output
    left plain decoding's at batch 16-32 (bench engine, sessions 27-28). Each bucket is tried
    on random rows against the same rows computed alone (up to ALONE_ROWS, every whole call of
    it among them) or in pieces already found exact; a row count that fails runs padded up to
    a good one or in good pieces, whichever the call times measured here price lower (a
    padding row priced like a computed one). Building a plan also builds oneDNN's kernel for
    every bucket (~0.75 ms each), so no step builds one.

    run: x [m, width] -> [m, out], one oneDNN call at m rows."""

    def __init__(self, run, width: int, dtype: torch.dtype, max_rows: int):
        buckets = sorted({onednn_rows(m) for m in range(1, max_rows + 1)})
        # heavy-tailed rows: sums that cancel, so that a changed order shows in the rounded
        # output (with plain normal rows one 48-row call in three looked exact when it was not)
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(max(max_rows, ALONE_ROWS), width, generator=g)
             * torch.exp(2 * torch.randn(max(max_rows, ALONE_ROWS), width, generator=g))).to(dtype)
        alone = torch.cat([run(x[i:i + 1]) for i in range(ALONE_ROWS)])
        good, seconds = {}, {}
        for m in buckets:
            if m <= ALONE_ROWS:         # every whole call of m rows among the rows run alone
                good[m] = all(torch.equal(run(x[i:i + m]), alone[i:i + m])
                              for i in range(0, ALONE_ROWS - m + 1, m))
            else:                       # against pieces already found exact
                piece = max(p for p in good if good[p] and p <= ALONE_ROWS)
                ref = torch.cat([run(x[i:i + piece]) for i in range(0, m, piece)])[:m]
                good[m] = torch.equal(run(x[:m]), ref)
            seconds[m] = min(_timed(run, x[:m]) for _ in range(3))
        self.good = [m for m in buckets if good[m]]
        for a, b in zip(self.good, self.good[1:]):     # more rows never priced lower (noise)
            seconds[b] = max(seconds[a], seconds[b])
        self.plans: dict[int, tuple[int, ...]] = {}
        best: dict[int, float] = {}
        for m in buckets:                       # cheapest good calls covering m rows
            up = next((g for g in self.good if g >= m), None)
            # padding writes its zero rows first: priced like computing them again
            top = max(g for g in self.good if g <= m)      # (1 always is): whole pieces of it
            options = [((top,) * -(-m // top), seconds[top] * -(-m // top))]
            if up is not None:
                options.append(((up,), seconds[up] * (2 - m / up)))
            for g in self.good:
                rest = onednn_rows(m - g) if g < m else m
                if rest < m:
                    options.append(((g,) + self.plans[rest], seconds[g] + best[rest]))
            self.plans[m], best[m] = min(options, key=lambda o: o[1])
        self.max_rows, self.largest = buckets[-1], self.good[-1]

    def calls(self, rows: int) -> tuple[int, ...]:
        """The row counts to call at (good buckets), in order, covering `rows`."""
        if rows <= self.max_rows:                     # every step's case: one lookup
            return self.plans[onednn_rows(rows)]
        pieces = -(-(rows - self.max_rows) // self.largest)
        return (self.largest,) * pieces + self.calls(rows - pieces * self.largest)


def _prepare(weight: torch.Tensor, kernel: str) -> torch.Tensor:
    """[out, in] weight -> the layout `kernel` reads."""
    if kernel == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    if kernel == "mkl":
        return weight.t().contiguous()
    return weight


class LlamaLayerWeights:
    """One decoder layer, with fused and (for tp_size > 1) split weights."""

    def __init__(self, layer, plan: dict, rank: int, world: int):
        attn, mlp = layer.self_attn, layer.mlp
        style = {name: plan.get(f"layers.*.{name}", "replicate") for name in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}

        def part(module, name):
            return _split(module.weight.data, style[name], rank, world)

        def part_bias(module, name):     # q, k, v biases follow their column-parallel rows
            return None if module.bias is None else _split(module.bias.data, style[name], rank, world)

        self.input_norm = layer.input_layernorm.weight.data
        self.post_norm = layer.post_attention_layernorm.weight.data
        # Column parallel: each rank holds its heads' rows of q, k, v, fused into one matmul.
        self.qkv = torch.cat([part(attn.q_proj, "self_attn.q_proj"), part(attn.k_proj, "self_attn.k_proj"),
                              part(attn.v_proj, "self_attn.v_proj")], dim=0)
        biases = [part_bias(attn.q_proj, "self_attn.q_proj"), part_bias(attn.k_proj, "self_attn.k_proj"),
                  part_bias(attn.v_proj, "self_attn.v_proj")]
        self.qkv_bias = torch.cat(biases) if biases[0] is not None else None
        # Row parallel: each rank holds the input columns of its heads; partial sums are all-reduced.
        self.o_proj = part(attn.o_proj, "self_attn.o_proj")
        self.o_bias = attn.o_proj.bias.data if attn.o_proj.bias is not None and rank == 0 else None
        # Column parallel gate and up (fused), row parallel down.
        self.gate_up = torch.cat([part(mlp.gate_proj, "mlp.gate_proj"), part(mlp.up_proj, "mlp.up_proj")], dim=0)
        self.down = part(mlp.down_proj, "mlp.down_proj")
        self.down_bias = mlp.down_proj.bias.data if getattr(mlp.down_proj, "bias", None) is not None and rank == 0 else None


class LlamaForward:
    """Runs a transformers Llama-family model's weights on a flat batch of tokens.

    `rank`/`world` shard the weights; `all_reduce` (e.g. a timed gloo/NCCL all-reduce) sums the
    row-parallel partial outputs and is required when world > 1.
    """

    def __init__(self, hf_model, rank: int = 0, world: int = 1,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        config = hf_model.config
        if config.model_type not in SUPPORTED:
            raise ValueError(f"the engine runs the Llama family {sorted(SUPPORTED)}; "
                             f"got model_type {config.model_type!r}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {config.hidden_act!r}")
        if world > 1 and all_reduce is None:
            raise ValueError("tensor parallelism needs an all_reduce function")
        self.config = config
        self.shape = LlamaShape.from_config(config, world)
        self.rank, self.world, self.all_reduce = rank, world, all_reduce
        plan = dict(getattr(config, "base_model_tp_plan", None) or {})
        base = hf_model.model
        self.embed = base.embed_tokens.weight.data
        self.final_norm = base.norm.weight.data
        self.lm_head = hf_model.lm_head.weight.data
        self.layers = [LlamaLayerWeights(layer, plan, rank, world) for layer in base.layers]
        on_cpu = self.embed.device.type == "cpu"
        self.kernel = _cpu_kernel(self.embed.dtype) if on_cpu else "torch"
        # the elementwise steps as C++ calls (engine/cpu_ops.py): the model runner turns this on
        # where it built them (with the attention kernel, at its start)
        self.cpu_ops = False
        self.lm_head = _prepare(self.lm_head, self.kernel)
        for w in self.layers:
            w.qkv, w.o_proj = _prepare(w.qkv, self.kernel), _prepare(w.o_proj, self.kernel)
            w.gate_up, w.down = _prepare(w.gate_up, self.kernel), _prepare(w.down, self.kernel)
        rotary = base.rotary_emb
        self.inv_freq = rotary.inv_freq.detach().float()           # [head_dim / 2]
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        # oneDNN: per projection shape, the calls that keep every row bit-exact (`RowPlan`),
        # and each weight's plan by identity (the step's lookup; a shape's layers share one)
        self.row_plans: dict[tuple, RowPlan] = {}
        self._plan_of: dict[int, RowPlan] = {}
        if self.kernel == "onednn":
            projections = [(self.lm_head, None, PROBE_LOGIT_ROWS)] + [
                (w, b, PROBE_ROWS) for layer in self.layers
                for w, b in ((layer.qkv, layer.qkv_bias), (layer.o_proj, layer.o_bias),
                             (layer.gate_up, None), (layer.down, layer.down_bias))]
            with torch.inference_mode():
                for weight, bias, rows in projections:
                    key = (tuple(weight.shape), bias is None)    # [out, in], reordered too
                    if key not in self.row_plans:
                        self.row_plans[key] = RowPlan(
                            lambda x, w=weight, b=bias: self._onednn(x, w, b, x.shape[0]),
                            weight.shape[1], self.dtype, rows)
                    self._plan_of[id(weight)] = self.row_plans[key]

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        if self.kernel == "onednn":
            plan = self._plan_of.get(id(weight)) or self.row_plans[(tuple(weight.shape),
                                                                    bias is None)]
            calls = plan.calls(x.shape[0])
            if len(calls) == 1:
                return self._onednn(x, weight, bias, calls[0])
            outs, start = [], 0
            for m in calls:
                outs.append(self._onednn(x[start:start + m], weight, bias, m))
                start += m
            return torch.cat(outs)[:x.shape[0]]
        if self.kernel == "mkl":
            return torch.addmm(bias, x, weight) if bias is not None else x @ weight
        return F.linear(x, weight, bias)

    @staticmethod
    def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                padded: int) -> torch.Tensor:
        """One oneDNN call at `padded` rows (x's, then zero rows, dropped from the output)."""
        rows = x.shape[0]
        if padded != rows:
            x = F.pad(x, (0, 0, 0, padded - rows))
        out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return out[:rows] if padded != rows else out

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
        """hidden += delta (in place), then its norm: one C++ call on CPU (`engine/cpu_ops.py`)."""
        if self.cpu_ops:
            out = cpu_ops.add_norm(hidden, delta, weight, self.shape.rms_norm_eps)
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
            qk = cpu_ops.rope(qkv, heads, s.head_dim, cos, sin) if self.cpu_ops else None
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
            act = cpu_ops.silu_mul(gate_up) if self.cpu_ops else None
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
