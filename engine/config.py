"""Engine configuration: a dataclass checked on construction (the API edge uses pydantic)."""

from __future__ import annotations

import os
from dataclasses import dataclass


ATTENTION = ("sdpa", "fused", "flex")
PREFILL_MODES = ("mixed", "no_draft", "alone")


def default_prefill_align(max_num_batched_tokens: int) -> int:
    """`EngineConfig.prefill_align` when the config leaves it out: 64, or a quarter of a
    smaller token budget."""
    return min(64, max(1, max_num_batched_tokens // 4))


@dataclass
class EngineConfig:
    target: str                          # local Hugging Face folder
    draft: str | None = None             # None: baseline only
    dtype: str = "auto"                  # weights and KV; "auto": bfloat16 where the device
                                         # computes it natively (GPU, AVX512-BF16 or AMX CPU),
                                         # else float32
    device: str = "cpu"
    attention: str = "fused"             # "fused": the device's paged kernel for decode and
                                         # verify rows: on CPU the fused kernel
                                         # (engine/cpu_attention.py), bitwise the same whatever
                                         # the batch, so greedy speculative output equals plain
                                         # decoding in bfloat16 too; on a GPU FlexAttention over
                                         # the pool in place (engine/flex_attention.py).
                                         # "flex": FlexAttention on any device (eager on CPU:
                                         # tests); "sdpa": gather + SDPA everywhere.
                                         # docs/decisions/0004-cpu-kernels.md, 0037
    graphs: str = "auto"                 # decode and verify forwards from CUDA graphs
                                         # (engine/cuda_graphs.py): "auto" on a GPU's
                                         # FlexAttention path (under TP, over NCCL); "off";
                                         # "static": the graphs' padded forward without
                                         # capture, any device on FlexAttention's path
                                         # (tests). docs/decisions/0039-cuda-graphs.md
    graph_warmup: bool = False           # captured graphs: build and capture every bucket at
                                         # start (ModelRunner.warm_up), not at a bucket's first
                                         # two forwards in serving
    kv_budget_bytes: int | None = None   # None: from device memory (see engine.memory)
    gpu_memory_utilization: float = 0.90  # share of a GPU's memory this replica plans to use
    memory_reserve_bytes: int = 256 << 20  # activations and workspace kept out of the KV budget
    kv_resident: bool = False            # write the whole KV pool at start, so no served step
                                         # faults its pages in (engine/kv_cache.py); serving
                                         # configs turn it on, tests' many engines leave it off
    block_size: int = 16                 # target tokens per KV block
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None     # None: the target's max_position_embeddings
    max_waiting: int = 256               # queue bound; beyond it add_request refuses (429)
    adaptive_k: bool = True              # False: every speculative sequence drafts k_max each step
    prefill_mode: str = "mixed"          # a step that carries prompt tokens: "mixed" (the batch
                                         # decodes and drafts in it), "no_draft" (decodes, no
                                         # draft rounds) or "alone" (prompts in a step of their
                                         # own): time to first token against throughput,
                                         # docs/decisions/0008-prefill-mode.md
    prefill_align: int | None = None     # prompts are cut into chunks only at multiples of
                                         # this (or their end) and attended in pieces of it, so
                                         # a prompt's KV is the same bits under any load
                                         # (engine/attention.py, `_Prefill`); None: 64, or a
                                         # quarter of a smaller token budget (a prompt waits
                                         # while the step's decodes leave less than one piece).
                                         # 64 costs prefill ~1% over one call a chunk:
                                         # docs/decisions/0007-prefill-alignment.md
    enable_prefix_caching: bool = True   # reuse the KV of cached prompt prefixes (target and
                                         # draft), skipping their prefill; output unchanged
                                         # (docs/decisions/0028-prefix-caching.md)
    num_threads: int | None = None       # torch threads; None: min(2, free cores)
    tp_size: int = 1
    profile: bool = True                 # measure the step-cost model at start (cached)
    cost_cache_dir: str | None = None    # None: ~/.cache/specserve/costs
    # oneDNN row plans, one file per projection shape and machine (models/cpu_linear.py);
    # None: ~/.cache/specserve/rowplans, "": built at every start, not kept
    row_plan_dir: str | None = None
    # compiled JSON grammars, one file per regex and vocabulary (engine/grammar.py);
    # None: ~/.cache/specserve/grammars, "": compiled at each engine's first use, not kept
    grammar_cache_dir: str | None = None
    prior_acceptance: float = 0.7        # acceptance assumed before any is measured
    seed: int = 0
    fault_injection: bool = False        # TEST ONLY: allow inject_fault (engine/faults.py)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 16:
            raise ValueError("block_size, max_num_seqs >= 1 and max_num_batched_tokens >= 16")
        if self.prefill_align is None:
            self.prefill_align = default_prefill_align(self.max_num_batched_tokens)
        if (not isinstance(self.prefill_align, int) or isinstance(self.prefill_align, bool)
                or not 1 <= self.prefill_align <= self.max_num_batched_tokens):
            raise ValueError(f"prefill_align must be an integer in [1, max_num_batched_tokens "
                             f"({self.max_num_batched_tokens})], got {self.prefill_align!r}")
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {self.prefill_mode!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        if not 0.0 < self.prior_acceptance < 1.0:
            raise ValueError("prior_acceptance must be in (0, 1)")
        if self.tp_size < 1:
            raise ValueError("tp_size must be >= 1")
        if self.graphs not in ("auto", "off", "static"):
            raise ValueError(f"graphs must be auto, off or static, got {self.graphs!r}")
        if not isinstance(self.graph_warmup, bool):
            raise ValueError(f"graph_warmup must be true or false, got {self.graph_warmup!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.num_threads is None:
            self.num_threads = max(1, min(2, len(os.sched_getaffinity(0))))
