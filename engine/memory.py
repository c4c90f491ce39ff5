"""The KV byte budget of a replica: what the device holds beyond weights and activations.

On a GPU, vLLM's convention (`MemoryPlan`): the replica may use `gpu_memory_utilization` of the
device; the KV budget is that, less the weights, the peak activations of the largest forward a
step can run (measured after loading by `measure_gpu`: a target forward at the step's token
budget and a draft round at `max_num_seqs` sequences), memory outside torch's allocator (CUDA
context, NCCL buffers) and the CUDA-graph pool (`graph_pool_bytes`). A budget that cannot hold
one `max_model_len` sequence (target and draft KV) is an error at start that prints the
numbers. Other ranks of a tensor-parallel group take rank 0's block count (rank 0 holds the
draft too, so it is the one with least room).
On a CPU there is no device to fill, so the budget is a quarter of the available RAM, capped at
2 GiB. `kv_budget_bytes` overrides either.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

CPU_CAP = 2 << 30
PLAN_K = 8                    # draft tokens a sequence may propose in one step, for planning


class InsufficientMemoryError(MemoryError):
    """The device cannot hold the weights, the activations and one full-length sequence."""


@dataclass(frozen=True)
class MemoryPlan:
    """One replica's (rank's) device memory, in bytes."""
    device_bytes: int
    utilization: float
    weight_bytes: int             # this rank's weights (the target's shard, and the draft)
    activation_bytes: int         # peak of the largest forward, beyond the weights
    other_bytes: int              # outside torch's allocator: CUDA context, NCCL buffers
    graph_pool_bytes: int
    kv_bytes_per_token: int       # this rank's target KV heads + the draft's, per token
    max_model_len: int

    @property
    def usable_bytes(self) -> int:
        return int(self.utilization * self.device_bytes)

    @property
    def kv_budget_bytes(self) -> int:
        return (self.usable_bytes - self.weight_bytes - self.activation_bytes - self.other_bytes
                - self.graph_pool_bytes)

    @property
    def min_kv_bytes(self) -> int:
        """One sequence of `max_model_len` tokens, target and draft."""
        return self.max_model_len * self.kv_bytes_per_token

    @property
    def max_tokens(self) -> int:
        return max(0, self.kv_budget_bytes) // max(1, self.kv_bytes_per_token)

    def describe(self) -> str:
        gib = 1 << 30
        rows = [("device memory", self.device_bytes),
                (f"x gpu_memory_utilization {self.utilization:.2f}", self.usable_bytes),
                ("- weights", self.weight_bytes), ("- peak activations", self.activation_bytes),
                ("- outside torch (context, NCCL)", self.other_bytes),
                ("- CUDA-graph pool", self.graph_pool_bytes),
                ("= KV budget", self.kv_budget_bytes),
                (f"one {self.max_model_len}-token sequence needs", self.min_kv_bytes)]
        lines = [f"  {name:<40} {value / gib:9.2f} GiB" for name, value in rows]
        lines.append(f"  {'KV tokens (target + draft)':<40} {self.max_tokens:9d}"
                     f"  ({self.kv_bytes_per_token} bytes a token)")
        return "\n".join(lines)

    def check(self) -> None:
        if self.kv_budget_bytes < self.min_kv_bytes:
            raise InsufficientMemoryError(
                "the KV budget cannot hold one max_model_len sequence; lower max_model_len, "
                "max_num_batched_tokens or max_num_seqs, raise gpu_memory_utilization, or use "
                "more GPUs:\n" + self.describe())


def activation_bytes(hidden: int, q_width: int, kv_width: int, mlp_width: int, vocab: int,
                     dtype_bytes: int, tokens: int, logit_rows: int) -> int:
    """An estimate of a forward's peak activations (`models plan` with no device to measure on):
    per token the residual stream, its norm and a layer's output (3 x hidden), q, k and v, the
    attention output, gate and up and their product (3 x MLP); widths are this rank's. Logits
    are float32, and sampling keeps two more tensors of their size (probabilities, noise)."""
    per_token = 3 * hidden + q_width + 2 * kv_width + q_width + 3 * mlp_width
    return tokens * per_token * dtype_bytes + 3 * logit_rows * vocab * 4


def graph_pool_bytes(shapes: list[tuple[int, int, int, int]], dtype_bytes: int,
                     max_num_seqs: int) -> int:
    """The CUDA graphs' memory pool (engine/cuda_graphs.py), shared by the target's and the
    draft's graphs: the activations of the largest captured forward (max_num_seqs sequences of
    8 query tokens, hidden states only: logits run outside the graphs) and the hidden states
    each captured bucket keeps as its output. shapes: (hidden, q width, kv width, MLP width)
    of each runner that captures graphs (the target's: this rank's widths); none: 0."""
    if not shapes:
        return 0
    from engine.cuda_graphs import GRAPH_QUERY_BUCKETS, graph_buckets

    top = GRAPH_QUERY_BUCKETS[-1]
    kept = sum(b * q + 1 for b, q in graph_buckets(max_num_seqs))             # tokens
    return (max(activation_bytes(*shape, 0, dtype_bytes, max_num_seqs * top + 1, 0)
                for shape in shapes)
            + sum(shape[0] for shape in shapes) * kept * dtype_bytes)


def plan_tokens(max_num_batched_tokens: int, max_num_seqs: int, k: int = PLAN_K) -> int:
    """The most tokens one target forward carries: a step's token budget, or every running
    sequence verifying k drafts (k + 1 tokens each), whichever is more."""
    return max(max_num_batched_tokens, max_num_seqs * (k + 1))


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def cpu_kv_budget_bytes(config) -> int:
    """config: EngineConfig. A quarter of the available RAM, capped at CPU_CAP."""
    budget = min(CPU_CAP, available_ram_bytes() // 4 - config.memory_reserve_bytes)
    if budget <= 0:
        raise MemoryError(f"no memory left for the KV cache after a "
                          f"{config.memory_reserve_bytes}-byte reserve")
    return int(budget)


@torch.inference_mode()
def measure_gpu(engine) -> MemoryPlan:
    """Rank 0's plan on its GPU, once its target shard and draft are loaded: the peak of
    `profile_forwards`, measured by torch's allocator."""
    from engine.cuda_graphs import graph_mode

    c = engine.config
    device = torch.device(c.device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    scratch = profile_forwards(engine)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch      # not the scratch pool
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    other = max(0, total - free - torch.cuda.memory_reserved(device))
    per_token = pool_bytes_per_token(engine)
    t, d = engine.target_fw.shape, engine.draft_fw.shape if engine.draft_fw else None
    models = [(engine.target_model, t, c.tp_size)] + ([(engine.draft_model, d, 1)] if d else [])
    shapes = [(f.hidden_size, f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim,
               m.config.intermediate_size // world) for m, f, world in models]   # a rank's
    collectives = dist.get_backend() if c.tp_size > 1 and dist.is_initialized() else None
    captured = (graph_mode(c.graphs, device, c.attention, collectives),
                graph_mode(c.graphs, device, c.attention))         # target's, draft's
    pool_graphs = graph_pool_bytes([s for s, m in zip(shapes, captured) if m == "capture"],
                                   engine.target_fw.dtype.itemsize, c.max_num_seqs)
    return MemoryPlan(total, c.gpu_memory_utilization, weights, peak - weights, other,
                      pool_graphs, per_token, engine.max_model_len)


@torch.inference_mode()
def profile_forwards(engine) -> int:
    """The largest forwards a step can run, over a scratch pool: a target forward at
    `plan_tokens` tokens (one sequence's prefill), a draft round over `max_num_seqs` sequences,
    and the verify's float32 logits. Returns the scratch pool's bytes (not activations).
    Under tensor parallelism rank 0 runs its shard alone, its all-reduces skipped: they add no
    activation, and the other ranks cannot join a forward before they take rank 0's plan."""
    from engine.attention import SeqSlice
    from engine.kv_cache import BlockPool
    from engine.kv_rules import blocks_needed
    from engine.model_runner import ModelRunner

    c = engine.config
    device = torch.device(c.device)
    t, d = engine.target_fw.shape, engine.draft_fw.shape if engine.draft_fw else None
    tokens = plan_tokens(c.max_num_batched_tokens, c.max_num_seqs)
    need = blocks_needed(tokens, c.block_size) + c.max_num_seqs * blocks_needed(2, c.block_size)
    pool = BlockPool(0, (t.num_layers, t.num_kv_heads, t.head_dim), c.block_size,
                     engine.target_fw.dtype, device,
                     (d.num_layers, d.num_kv_heads, d.head_dim) if d else None,
                     num_blocks=need)
    target = ModelRunner(engine.target_fw, pool.layers(pool.target), attention="sdpa")
    table = pool.allocate(blocks_needed(tokens, pool.target.tokens_per_block), "target")
    all_reduce, engine.target_fw.all_reduce = engine.target_fw.all_reduce, lambda x: x
    try:
        target.hidden([SeqSlice(table, 0, tokens)], [1] * tokens, list(range(tokens)))
    finally:
        engine.target_fw.all_reduce = all_reduce
    if engine.draft_fw is not None:
        draft = ModelRunner(engine.draft_fw, pool.layers(pool.draft), attention="sdpa")
        seqs = [SeqSlice(pool.allocate(1, "draft"), 0, 1) for _ in range(c.max_num_seqs)]
        draft.run(seqs, [1] * len(seqs), [0] * len(seqs), list(range(len(seqs))))
        del draft
    # the verify's logits: every sequence's k + 1 rows, in float32, and sampling's copies
    rows = c.max_num_seqs * (PLAN_K + 1)
    logits = torch.empty(3, rows, t.vocab_size, dtype=torch.float32, device=device)
    del logits, target
    return pool.budget_bytes


def pool_bytes_per_token(engine) -> int:
    """KV bytes a token of a speculating sequence costs on rank 0: the target's (this rank's
    heads) and the draft's."""
    element = torch.empty((), dtype=engine.target_fw.dtype).element_size()
    total = 0
    for fw in filter(None, (engine.target_fw, engine.draft_fw)):
        s = fw.shape
        total += 2 * s.num_layers * s.num_kv_heads * s.head_dim * element
    return total


CUDA_CONTEXT_BYTES = 1 << 30    # planned without a device: CUDA context, cuBLAS and NCCL buffers


def plan_from_specs(device_bytes: int, utilization: float, target, draft, tp: int,
                    dtype_bytes: int, max_num_batched_tokens: int, max_num_seqs: int,
                    max_model_len: int, k: int = PLAN_K) -> MemoryPlan:
    """Rank 0's plan from datasheet shapes (`engine.hardware.ModelSpec`), no device needed:
    what `specserve models plan` prints. Activations are `activation_bytes`' estimate for the
    larger of a target forward at `plan_tokens` and a draft round at `max_num_seqs`."""
    q = target.num_heads * target.hd // tp
    kv = target.num_kv_heads * target.hd // tp
    tokens = plan_tokens(max_num_batched_tokens, max_num_seqs, k)
    act = activation_bytes(target.hidden_size, q, kv, target.intermediate_size // tp,
                           target.vocab_size, dtype_bytes, tokens, max_num_seqs * (k + 1))
    weights = target.rank_weight_bytes(tp, dtype_bytes)
    per_token = target.kv_bytes_per_token(dtype_bytes) // tp
    shapes = [(target.hidden_size, q, kv, target.intermediate_size // tp)]
    if draft is not None:
        shapes.append((draft.hidden_size, draft.num_heads * draft.hd,
                       draft.num_kv_heads * draft.hd, draft.intermediate_size))
        act = max(act, activation_bytes(draft.hidden_size, draft.num_heads * draft.hd,
                                        draft.num_kv_heads * draft.hd, draft.intermediate_size,
                                        draft.vocab_size, dtype_bytes, max_num_seqs,
                                        max_num_seqs))
        weights += draft.rank_weight_bytes(1, dtype_bytes)
        per_token += draft.kv_bytes_per_token(dtype_bytes)
    # CUDA graphs for the target (over NCCL at tp > 1) and the draft (engine/cuda_graphs.py)
    return MemoryPlan(device_bytes, utilization, weights, act, CUDA_CONTEXT_BYTES,
                      graph_pool_bytes(shapes, dtype_bytes, max_num_seqs),
                      per_token, max_model_len)
