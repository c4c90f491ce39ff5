"""One model's forward over the paged KV cache: token ids in, logits for chosen rows out.

Owns: packing a ragged batch into flat tensors and running the model's forward with paged
attention. With tensor parallelism the same inputs go to every rank (`peers`), each runs its
shard, and rank 0 (this process) reads the logits. Does not own: sampling or scheduling.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention import PagedAttention, SeqSlice
from engine.cpu_attention import paged_attention


class Peers(Protocol):
    """The other ranks of a tensor-parallel group (see deployments/tp_group.py)."""

    def configure_pool(self, tokens_per_block: int, num_blocks: int, dtype: str) -> None:
        """Give every rank rank 0's KV pool layout (called once, before the first forward);
        a rank whose weights are in another dtype than rank 0's (`dtype`) refuses."""

    def launch(self, input_ids: list[int], positions: list[int], seqs: list[SeqSlice]) -> None: ...

    def wait(self) -> None: ...


class ModelRunner:
    def __init__(self, forward, layers: list[tuple[torch.Tensor, torch.Tensor]],
                 peers: Peers | None = None, attention: str = "fused"):
        self.forward = forward            # models.llama.LlamaForward
        self.layers = layers              # per layer (K, V) views of the pool (BlockPool.layers)
        self.peers = peers
        self.scale = forward.shape.head_dim ** -0.5
        self.device = forward.device
        self.workspace: dict = {}         # attention's gather buffers, reused across steps
        # attention "fused": every decode and verify group on CPU runs the fused kernel
        # (engine/cpu_attention.py: bitwise batch-invariant rows); False: gather + SDPA.
        self.fused = attention == "fused" and self.device.type == "cpu"
        if self.fused:
            self._build_fused()

    @torch.inference_mode()
    def _build_fused(self) -> None:
        """Build the fused kernel for this model's dtype and head size now (a cold build takes
        ~5-20 s; inductor's on-disk cache then brings it to well under a second a process), not
        in the middle of serving, and find out whether it can be built here at all."""
        k_cache, v_cache = self.layers[0]
        kv_heads, d = k_cache.shape[-2], k_cache.shape[-1]
        group = self.forward.shape.num_heads // kv_heads
        q = torch.zeros(1, kv_heads * group, d, dtype=k_cache.dtype, device=self.device)
        one = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        if not paged_attention(q, k_cache, v_cache, one, one + 1, one, torch.empty_like(q),
                               self.scale):
            self.fused = False                       # cannot build it here: gather + SDPA

    @torch.inference_mode()
    def run(self, seqs: list[SeqSlice], input_ids: list[int], positions: list[int],
            logit_rows: list[int]) -> torch.Tensor:
        """Feed `input_ids` (flat, sequence after sequence) -> logits [len(logit_rows), vocab]."""
        if self.peers is not None:
            self.peers.launch(input_ids, positions, seqs)
        hidden = self.hidden(seqs, input_ids, positions)
        if self.peers is not None:
            self.peers.wait()
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        return self.forward.logits(hidden[rows])

    @torch.inference_mode()
    def hidden(self, seqs: list[SeqSlice], input_ids: list[int], positions: list[int]) -> torch.Tensor:
        """The forward alone (what every rank of a tensor-parallel group runs)."""
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        attn = PagedAttention(self.layers, seqs, self.scale, self.workspace, fused=self.fused)
        return self.forward.forward(ids, pos, attn)
